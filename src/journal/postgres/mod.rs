//! The PostgreSQL journal (issue 15): one database shared by every turnguard replica.
//!
//! The same tables and columns as the SQLite schema (`migrations/postgres/`, run by
//! `refinery` under an advisory lock so replicas starting together migrate once), written by
//! one writer task per process that commits the queued [`super::Op`]s in groups — each job in
//! its own savepoint, so a job that fails (a constraint, a fenced claim) fails alone. A batch
//! holding a durable record commits with `synchronous_commit = on` and its callers wait for
//! the commit; a relaxed batch commits with `synchronous_commit = off`.
//!
//! What the single SQLite writer guaranteed by being alone holds here by statements that are
//! atomic across replicas:
//! - effect claims: `INSERT … ON CONFLICT DO NOTHING RETURNING epoch`; a take-over (the
//!   owner's lease ran out, or its replica is dead: the session-level advisory lock
//!   `hashtextextended(instance, 0)` it holds on its `LISTEN` connection is gone, which the
//!   server sees the moment that process's connection ends, `kill -9` included) bumps
//!   `effects.epoch`, and a confirm or release must match the epoch its claim returned
//!   (kept per process), so a stalled owner that lost its claim fails closed
//!   ([`super::JournalError::Fenced`]);
//! - interrupts: insert-if-absent on the key, compare-and-set from `pending`, consumed once;
//!   a resolution sends `NOTIFY turnguard_interrupts, '<interrupt id>'` in its transaction,
//!   which the `LISTEN` task of every replica turns into a wake-up of its waiters
//!   ([`super::Journal::resolved_elsewhere`]); polling covers a listener that is down;
//! - event sequences: per scope under a transaction-scoped advisory lock.

pub(super) mod reader;
mod writer;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_postgres::config::SslMode;

use super::{
    InterruptState, Journal, JournalError, JournalHealth, JournalLocation, Store, WriterKind,
    WriterThread, QUEUE_CAPACITY,
};
use crate::metrics::Metrics;

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// The channel a resolution notifies, payload the interrupt id.
pub const CHANNEL: &str = "turnguard_interrupts";

/// How often a waiter reads its interrupt while the `LISTEN` connection is down.
pub const POLL_WHILE_DEAF: Duration = Duration::from_millis(500);

/// Connections in one replica's pool (the writer task, readers, the admin plane).
const POOL_SIZE: usize = 16;

/// How long a request waits for a pooled connection, a new connection, or a batch commit
/// before it fails (503): a database that went away fails requests fast, not after the TCP
/// timeout.
const WAIT: Duration = Duration::from_secs(3);

/// How long [`open`] waits for the `LISTEN` connection (which holds the replica's liveness
/// lock) before it goes on without it.
const LIVENESS_WAIT: Duration = Duration::from_secs(5);

/// Key of the advisory lock the migration runs under.
const MIGRATION_LOCK: i64 = 0x7475_726e_6775_6172; // "turnguar"

/// What every handle of one PostgreSQL journal shares.
#[derive(Clone)]
pub(super) struct Shared(Arc<Inner>);

struct Inner {
    pool: Pool,
    /// Interrupt ids other replicas (or this one) resolved, from `LISTEN`.
    notices: broadcast::Sender<String>,
    /// The `LISTEN` connection is up (and holds the liveness lock).
    listening: watch::Sender<bool>,
}

impl Shared {
    pub(super) fn pool(&self) -> Pool {
        self.0.pool.clone()
    }

    /// See [`Journal::resolved_elsewhere`].
    pub(super) async fn resolved(&self, journal: &Journal, id: &str) -> InterruptState {
        let mut rx = self.0.notices.subscribe();
        let mut up = self.0.listening.subscribe();
        // A resolution committed before the subscription is read once now.
        let mut check = true;
        loop {
            if check {
                if let Ok(Some(row)) = journal.interrupt(id).await {
                    if row.state != InterruptState::Pending {
                        return row.state;
                    }
                }
            }
            let listening = *up.borrow_and_update();
            check = if listening {
                tokio::select! {
                    got = rx.recv() => match got {
                        Ok(notified) => notified == id,
                        // Missed notifications, or none will come: read the row.
                        Err(_) => true,
                    },
                    // The listener went down (a notification may be lost): read the row.
                    _ = up.changed() => true,
                }
            } else {
                tokio::time::sleep(POLL_WHILE_DEAF).await;
                true
            };
        }
    }
}

/// How turnguard connects: plain TCP, or TLS verified against the web PKI roots (and the
/// `sslrootcert` file when the URL names one).
#[derive(Clone)]
enum Tls {
    Plain,
    Rustls(tokio_postgres_rustls::MakeRustlsConnect),
}

fn open_err(location: &JournalLocation, reason: impl std::fmt::Display) -> JournalError {
    JournalError::Open {
        path: location.to_string().into(),
        reason: reason.to_string(),
    }
}

/// Parses the URL: `sslmode` is read here (`disable` or absent: plain TCP; `require`,
/// `verify-ca`, `verify-full`: TLS with the server's certificate verified — turnguard never
/// encrypts without verifying), `sslrootcert=<PEM file>` adds trust anchors; the rest goes
/// to `tokio_postgres::Config`.
fn config(
    url: &str,
    location: &JournalLocation,
) -> Result<(tokio_postgres::Config, Tls), JournalError> {
    let mut parsed =
        url::Url::parse(url).map_err(|e| open_err(location, format!("not a URL: {e}")))?;
    let mut sslmode: Option<String> = None;
    let mut rootcert: Option<String> = None;
    let kept: Vec<(String, String)> = parsed
        .query_pairs()
        .filter_map(|(k, v)| match k.as_ref() {
            "sslmode" => {
                sslmode = Some(v.into_owned());
                None
            }
            "sslrootcert" => {
                rootcert = Some(v.into_owned());
                None
            }
            _ => Some((k.into_owned(), v.into_owned())),
        })
        .collect();
    parsed.set_query(None);
    if !kept.is_empty() {
        parsed.query_pairs_mut().extend_pairs(kept);
    }
    let mut cfg =
        tokio_postgres::Config::from_str(parsed.as_str()).map_err(|e| open_err(location, e))?;
    cfg.application_name("turnguard");
    cfg.connect_timeout(WAIT);
    cfg.keepalives(true);
    cfg.keepalives_idle(Duration::from_secs(10));
    let tls = match sslmode.as_deref() {
        None | Some("disable") => {
            cfg.ssl_mode(SslMode::Disable);
            Tls::Plain
        }
        Some("require" | "verify-ca" | "verify-full") => {
            cfg.ssl_mode(SslMode::Require);
            Tls::Rustls(rustls_connector(rootcert.as_deref(), location)?)
        }
        Some(other) => {
            return Err(open_err(
                location,
                format!("sslmode={other} is not supported: use disable, require or verify-full"),
            ))
        }
    };
    Ok((cfg, tls))
}

fn rustls_connector(
    rootcert: Option<&str>,
    location: &JournalLocation,
) -> Result<tokio_postgres_rustls::MakeRustlsConnect, JournalError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = rootcert {
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
            .map_err(|e| open_err(location, format!("sslrootcert {path}: {e}")))?;
        for cert in certs {
            let cert = cert.map_err(|e| open_err(location, format!("sslrootcert {path}: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| open_err(location, format!("sslrootcert {path}: {e}")))?;
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| open_err(location, e))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
}

fn pool(
    cfg: tokio_postgres::Config,
    tls: &Tls,
    location: &JournalLocation,
) -> Result<Pool, JournalError> {
    let mc = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match tls {
        Tls::Plain => Manager::from_config(cfg, tokio_postgres::NoTls, mc),
        Tls::Rustls(t) => Manager::from_config(cfg, t.clone(), mc),
    };
    Pool::builder(manager)
        .max_size(POOL_SIZE)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(WAIT))
        .create_timeout(Some(WAIT))
        .recycle_timeout(Some(WAIT))
        .build()
        .map_err(|e| open_err(location, e))
}

/// A pool for reads only (the journal CLI, `policy learn`): nothing is migrated or written.
pub(super) async fn read_pool(url: &str, location: &JournalLocation) -> Result<Pool, JournalError> {
    let (cfg, tls) = config(url, location)?;
    let pool = pool(cfg, &tls, location)?;
    drop(pool.get().await.map_err(|e| open_err(location, e))?);
    Ok(pool)
}

/// Opens the journal (see [`Journal::open`]).
pub(super) async fn open(
    url: &str,
    location: &JournalLocation,
    metrics: Arc<Metrics>,
) -> Result<(Journal, WriterThread), JournalError> {
    let (cfg, tls) = config(url, location)?;
    let pool = pool(cfg.clone(), &tls, location)?;
    migrate(&pool).await.map_err(|e| open_err(location, e))?;
    let instance = uuid::Uuid::new_v4().to_string();
    // The probe write: the journal must be writable before turnguard says it is up.
    writer::heartbeat(&pool, &instance)
        .await
        .map_err(|e| open_err(location, format!("the journal is not writable: {e}")))?;
    let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
    let health = Arc::new(JournalHealth::default());
    let (notices, _) = broadcast::channel(1024);
    let shared = Shared(Arc::new(Inner {
        pool: pool.clone(),
        notices,
        listening: watch::channel(false).0,
    }));
    let listener = tokio::spawn(listen(cfg, tls, shared.clone(), instance.clone()));
    // Claims are taken only once this replica's liveness lock is held (else the others would
    // see its claims as a dead replica's); past the wait it goes on, fenced all the same.
    let mut up = shared.0.listening.subscribe();
    let up = tokio::time::timeout(LIVENESS_WAIT, up.wait_for(|up| *up)).await;
    if !matches!(up, Ok(Ok(_))) {
        tracing::warn!(journal = %location, "journal LISTEN connection not up yet; going on (cross-replica wake-ups poll)");
    }
    let writer = tokio::spawn(writer::run(
        pool,
        rx,
        Arc::clone(&metrics),
        Arc::clone(&health),
        instance,
    ));
    tracing::info!(journal = %location, "PostgreSQL journal open");
    Ok((
        Journal {
            tx,
            // The writer is a task: nothing to unpark.
            wake: super::WriterWake::default(),
            metrics,
            location: location.clone(),
            health,
            store: Store::Postgres(shared),
            seen: Arc::default(),
        },
        WriterThread(WriterKind::Task {
            writer,
            companions: vec![listener.abort_handle()],
            runtime: tokio::runtime::Handle::current(),
        }),
    ))
}

/// Runs the embedded migrations once, under a session advisory lock (replicas starting
/// together wait for the first).
async fn migrate(pool: &Pool) -> Result<(), String> {
    let mut client = pool.get().await.map_err(|e| e.to_string())?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(|e| describe(&e))?;
    let client_ref: &mut tokio_postgres::Client = &mut client;
    let result = embedded::migrations::runner()
        .run_async(client_ref)
        .await
        .map(|_| ())
        .map_err(|e| format!("migration failed: {e}"));
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(|e| describe(&e));
    result.and(unlocked.map(|_| ()))
}

/// The `LISTEN` task: one connection of its own (not pooled), re-made a second after it
/// drops, which also holds this replica's liveness lock (a session advisory lock on
/// `hashtextextended(instance, 0)`: while it is held, no other replica takes over this
/// replica's claims); every notification on [`CHANNEL`] is broadcast to this replica's
/// waiters.
async fn listen(cfg: tokio_postgres::Config, tls: Tls, shared: Shared, instance: String) {
    loop {
        let session = match &tls {
            Tls::Plain => listen_once(&cfg, tokio_postgres::NoTls, &shared, &instance).await,
            Tls::Rustls(t) => listen_once(&cfg, t.clone(), &shared, &instance).await,
        };
        shared.0.listening.send_replace(false);
        if let Err(e) = session {
            tracing::warn!(error = %e, "journal LISTEN connection down; waiters poll until it is back");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn listen_once<T>(
    cfg: &tokio_postgres::Config,
    tls: T,
    shared: &Shared,
    instance: &str,
) -> Result<(), String>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
    T::Stream: Send + 'static,
{
    use futures_util::StreamExt;
    let (client, mut conn) = cfg.connect(tls).await.map_err(|e| describe(&e))?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let driver = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(m) = messages.next().await {
            match m {
                Ok(tokio_postgres::AsyncMessage::Notification(n)) => {
                    if tx.send(n.payload().to_owned()).is_err() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(e) => return Err(describe(&e)),
            }
        }
        Ok(())
    });
    client
        .execute(
            "SELECT pg_advisory_lock(hashtextextended($1, 0))",
            &[&instance],
        )
        .await
        .map_err(|e| describe(&e))?;
    client
        .batch_execute(&format!("LISTEN {CHANNEL}"))
        .await
        .map_err(|e| describe(&e))?;
    shared.0.listening.send_replace(true);
    while let Some(id) = rx.recv().await {
        let _ = shared.0.notices.send(id);
    }
    drop(client);
    driver.await.map_err(|e| e.to_string())?
}

/// An error's text with the server's message (tokio-postgres shows only "db error").
pub(super) fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {} ({})", db.severity(), db.message(), db.code().code()),
        None => {
            use std::error::Error;
            match e.source() {
                Some(source) => format!("{e}: {source}"),
                None => e.to_string(),
            }
        }
    }
}

/// The error failed the store itself (connection, server shutting down, disk full, read-only),
/// not one record: it marks the journal failing ([`JournalHealth`]).
pub(super) fn store_failure(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        None => true,
        Some(code) => {
            let c = code.code();
            c.starts_with("08")
                || c.starts_with("53")
                || c.starts_with("57")
                || c.starts_with("58")
                || c.starts_with("XX")
                || c == "25006"
        }
    }
}

/// A read's error as the journal reports it.
pub(super) fn read_err(e: tokio_postgres::Error) -> JournalError {
    JournalError::Write(describe(&e))
}

/// A pool error as the journal reports it.
pub(super) fn pool_err(e: deadpool_postgres::PoolError) -> JournalError {
    JournalError::Write(format!("no journal connection: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls_of(url: &str) -> Result<&'static str, String> {
        let location = JournalLocation::parse(url);
        config(url, &location)
            .map(|(_, tls)| match tls {
                Tls::Plain => "plain",
                Tls::Rustls(_) => "tls",
            })
            .map_err(|e| e.to_string())
    }

    /// `sslmode` absent or `disable` is plain TCP; `require`, `verify-ca`, `verify-full` are
    /// verified TLS; the modes that may fall back to plain text are refused, and the error
    /// names the URL without its password.
    #[test]
    fn sslmode_selects_plain_or_verified_tls() {
        assert_eq!(tls_of("postgres://tg:pw@db/tg"), Ok("plain"));
        assert_eq!(
            tls_of("postgres://tg:pw@db/tg?sslmode=disable"),
            Ok("plain")
        );
        for mode in ["require", "verify-ca", "verify-full"] {
            assert_eq!(
                tls_of(&format!(
                    "postgresql://tg:pw@db:5432/tg?sslmode={mode}&connect_timeout=3"
                )),
                Ok("tls"),
                "{mode}"
            );
        }
        let refused = tls_of("postgres://tg:s3cret@db/tg?sslmode=prefer").unwrap_err();
        assert!(refused.contains("sslmode=prefer"), "{refused}");
        assert!(!refused.contains("s3cret"), "{refused}");
        let missing =
            tls_of("postgres://tg:s3cret@db/tg?sslmode=require&sslrootcert=/nonexistent.pem")
                .unwrap_err();
        assert!(missing.contains("sslrootcert"), "{missing}");
        assert!(!missing.contains("s3cret"), "{missing}");
    }
}
