//! The pooled outbound HTTP client every turnguard leg uses (upstream providers, MCP
//! servers, the identity provider, the approval webhook, the `approvals` CLI): hyper's
//! connection API (`hyper::client::conn`) over rustls with the webpki roots, plain HTTP
//! allowed for local targets, HTTP/2 when the server's ALPN picks it. Imports only the
//! configuration.
//!
//! Why not `hyper_util`'s legacy `Client`: on the request path it cost ~4.7 % of the c=64
//! cell's CPU — its checkout future, pool-key hashing, connection-info envelopes, and a task
//! spawned per HTTP/1 request to put the connection back once its response is read
//! (bench/RESULTS.md, issue 13 runs 35–37). This pool keeps what that client did for turnguard
//! and drops the rest:
//! - connections are keyed by scheme and authority; an HTTP/1 connection goes back to its
//!   key's list as soon as the response head arrives and is taken again once hyper says it
//!   is ready (its previous response read, [`hyper::client::conn::http1::SendRequest::is_ready`]),
//!   the most recently used ready one first, so a light load keeps to a few warm connections
//!   and the rest idle out; an HTTP/2 connection is shared by every request to its key;
//! - a request that hyper hands back unsent because a reused connection closed under it is
//!   sent again on another connection, four connections at most (what the legacy
//!   client's `retry_canceled_requests` did); one that was sent is never sent twice;
//! - connections idle for [`IDLE_TIMEOUT`] are closed (an HTTP/2 one counts as idle from the
//!   last request it was taken for), and at most [`MAX_PER_KEY`] HTTP/1 ones are kept per key;
//!   requests that find no connection each open one, so a burst to an origin not yet
//!   connected opens several HTTP/2 connections: the first is used from then on and the others
//!   close when idle;
//! - an HTTP/1 request is sent in origin form with a `Host` header from the URI (when the
//!   caller set none), an HTTP/2 request with the absolute URI.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{header, HeaderValue, Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tower_service::Service;

use crate::config::Config;

/// How long a connection may sit idle in the pool before it is closed (what the legacy
/// client's `pool_idle_timeout` was set to).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Connections kept per (scheme, authority); a connection beyond this is closed once its
/// response is read instead of being kept.
pub const MAX_PER_KEY: usize = 1024;
/// Connections a request is offered before it fails: a pooled connection that closed
/// before taking it is dropped and the next one (or a new one) tried.
const ATTEMPTS: usize = 4;
/// How often idle connections are looked for and closed.
const REAP_EVERY: Duration = Duration::from_secs(30);

/// The pooled client. Cloning shares the pool.
#[derive(Clone)]
pub struct HttpClient {
    inner: Arc<Inner>,
}

struct Inner {
    connector: HttpsConnector<HttpConnector>,
    /// Keyed by origin with foldhash (every origin comes from configuration, so no client
    /// chooses the keys; SipHash of an `Authority`, byte by byte, was ~1 k instructions a
    /// request).
    pool: Mutex<foldhash::HashMap<PoolKey, Conns>>,
    reaper: std::sync::Once,
}

type PoolKey = (Scheme, Authority);

/// The connections of one key.
#[derive(Default)]
struct Conns {
    /// HTTP/1 connections, in flight or idle, each with the instant its last response head
    /// arrived; the most recently used last.
    http1: Vec<(http1::SendRequest<Full<Bytes>>, Instant)>,
    /// HTTP/2 connections (each shared by concurrent requests), last taken at the instant.
    http2: Vec<(http2::SendRequest<Full<Bytes>>, Instant)>,
}

/// A connection taken for one request.
enum Conn {
    Http1(http1::SendRequest<Full<Bytes>>),
    Http2(http2::SendRequest<Full<Bytes>>),
}

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The URI has no scheme or authority, or a scheme other than `http`/`https`.
    #[error("the URI `{0}` is not an absolute http(s) URI")]
    InvalidUri(String),
    /// No connection could be made (DNS, TCP, TLS, or the HTTP/2 handshake).
    #[error("connection failed: {0}")]
    Connect(String),
    /// The connection failed after the request was handed to it.
    #[error("request failed: {0}")]
    Send(#[source] hyper::Error),
}

impl ClientError {
    /// Whether no connection could be made (the request never left turnguard).
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Connect(_))
    }
}

/// Builds the pooled client: HTTP/1.1 and HTTP/2 over rustls with the webpki roots, plain
/// HTTP allowed for local upstreams (vLLM, Ollama, mocks), `upstream_connect_timeout_ms` on
/// each TCP connect.
pub fn client(config: &Config) -> HttpClient {
    let https = hyper_rustls::HttpsConnectorBuilder::new().with_webpki_roots();
    with_tls(config, https)
}

/// [`client`] over the TLS settings `https` (a builder with its roots chosen).
fn with_tls(
    config: &Config,
    https: hyper_rustls::HttpsConnectorBuilder<hyper_rustls::builderstates::WantsSchemes>,
) -> HttpClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(Duration::from_millis(
        config.upstream_connect_timeout_ms,
    )));
    http.set_nodelay(true);
    let connector = https
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    HttpClient {
        inner: Arc::new(Inner {
            connector,
            pool: Mutex::new(foldhash::HashMap::default()),
            reaper: std::sync::Once::new(),
        }),
    }
}

impl HttpClient {
    /// Sends `req` (an absolute `http`/`https` URI) on a pooled connection, or a new one,
    /// and returns the response head with its body streaming. Must be called inside a tokio
    /// runtime (connections are driven by spawned tasks). No timeout of its own beyond the
    /// connect timeout: callers bound the wait.
    ///
    /// Errors: [`ClientError::InvalidUri`]; [`ClientError::Connect`] when no connection
    /// could be made; [`ClientError::Send`] when the connection failed after taking the
    /// request (it is not sent again: it may have reached the server).
    pub async fn request(
        &self,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, ClientError> {
        let uri = req.uri().clone();
        let key = key_of(&uri).ok_or_else(|| ClientError::InvalidUri(uri.to_string()))?;
        let mut req = req;
        for _ in 0..ATTEMPTS {
            let (conn, reused) = match self.checkout(&key) {
                Some(conn) => (conn, true),
                // Boxed: the connect and handshake futures are several KB, cold after the
                // first request to an origin, and would otherwise size every request's
                // future (which hyper's server moves into place per request).
                None => (Box::pin(self.connect(&key, &uri)).await?, false),
            };
            let unsent = match conn {
                Conn::Http1(mut tx) => {
                    to_origin_form(&mut req, &key);
                    match tx.try_send_request(req).await {
                        Ok(resp) => {
                            self.put_http1(key, tx);
                            return Ok(resp);
                        }
                        Err(mut e) => e
                            .take_message()
                            .ok_or_else(|| ClientError::Send(e.into_error()))?,
                    }
                }
                Conn::Http2(mut tx) => {
                    if let Err(e) = tx.ready().await {
                        if reused {
                            continue;
                        }
                        return Err(ClientError::Send(e));
                    }
                    match tx.try_send_request(req).await {
                        Ok(resp) => return Ok(resp),
                        Err(mut e) => e
                            .take_message()
                            .ok_or_else(|| ClientError::Send(e.into_error()))?,
                    }
                }
            };
            // hyper handed the request back unsent: the connection closed before it was
            // written. A fresh connection that does that will do it again.
            if !reused {
                return Err(ClientError::Connect(
                    "the connection closed before the request was sent".to_owned(),
                ));
            }
            req = unsent;
            *req.uri_mut() = uri.clone();
        }
        Err(ClientError::Connect(format!(
            "{ATTEMPTS} pooled connections closed before the request was sent"
        )))
    }

    /// A live connection for `key`: a shared HTTP/2 one, or the most recently used ready
    /// HTTP/1 one (so a light load keeps to a few warm connections and the rest idle out).
    /// Closed connections, and ready ones idle past [`IDLE_TIMEOUT`], are dropped on the way.
    fn checkout(&self, key: &PoolKey) -> Option<Conn> {
        let mut pool = self.inner.pool.lock().unwrap_or_else(|e| e.into_inner());
        let conns = pool.get_mut(key)?;
        conns.http2.retain(|(tx, since)| !http2_spent(tx, *since));
        if let Some((tx, since)) = conns.http2.first_mut() {
            *since = Instant::now();
            return Some(Conn::Http2(tx.clone()));
        }
        let mut i = conns.http1.len();
        while i > 0 {
            i -= 1;
            let (tx, since) = &conns.http1[i];
            if http1_spent(tx, *since) {
                conns.http1.remove(i);
            } else if tx.is_ready() {
                let (tx, _) = conns.http1.remove(i);
                return Some(Conn::Http1(tx));
            }
            // Otherwise still reading its previous response.
        }
        None
    }

    /// Keeps an HTTP/1 connection whose response head arrived (it becomes ready once that
    /// response is read), unless [`MAX_PER_KEY`] are kept (it then closes after it).
    fn put_http1(&self, key: PoolKey, tx: http1::SendRequest<Full<Bytes>>) {
        let mut pool = self.inner.pool.lock().unwrap_or_else(|e| e.into_inner());
        let conns = pool.entry(key).or_default();
        if conns.http1.len() < MAX_PER_KEY {
            conns.http1.push((tx, Instant::now()));
        }
    }

    /// Opens a connection to `uri`'s origin, HTTP/2 if ALPN picked it, and starts the task
    /// that drives it.
    async fn connect(&self, key: &PoolKey, uri: &Uri) -> Result<Conn, ClientError> {
        self.start_reaper();
        let origin = Uri::builder()
            .scheme(key.0.clone())
            .authority(key.1.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| ClientError::InvalidUri(format!("{uri}: {e}")))?;
        let io = self
            .inner
            .connector
            .clone()
            .call(origin)
            .await
            .map_err(|e| ClientError::Connect(e.to_string()))?;
        if io.connected().is_negotiated_h2() {
            let (tx, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await
                .map_err(|e| ClientError::Connect(format!("HTTP/2 handshake: {e}")))?;
            drive(conn, "HTTP/2");
            let mut pool = self.inner.pool.lock().unwrap_or_else(|e| e.into_inner());
            let conns = pool.entry(key.clone()).or_default();
            conns.http2.retain(|(tx, since)| !http2_spent(tx, *since));
            conns.http2.push((tx.clone(), Instant::now()));
            Ok(Conn::Http2(tx))
        } else {
            let (tx, conn) = http1::Builder::new()
                .handshake(io)
                .await
                .map_err(|e| ClientError::Connect(format!("HTTP/1 handshake: {e}")))?;
            drive(conn, "HTTP/1");
            Ok(Conn::Http1(tx))
        }
    }

    /// Starts, once, the task that closes idle connections every [`REAP_EVERY`]; it ends
    /// with the last clone of the client.
    fn start_reaper(&self) {
        self.inner.reaper.call_once(|| {
            let weak: Weak<Inner> = Arc::downgrade(&self.inner);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(REAP_EVERY);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    let Some(inner) = weak.upgrade() else { return };
                    let mut pool = inner.pool.lock().unwrap_or_else(|e| e.into_inner());
                    for conns in pool.values_mut() {
                        conns.http2.retain(|(tx, since)| !http2_spent(tx, *since));
                        conns.http1.retain(|(tx, since)| !http1_spent(tx, *since));
                    }
                    pool.retain(|_, c| !c.http1.is_empty() || !c.http2.is_empty());
                }
            });
        });
    }
}

/// Starts the task that drives a connection's reads and writes until it closes (a failure
/// is logged at `debug`: the request it failed has its own error).
fn drive<C>(conn: C, version: &'static str)
where
    C: std::future::Future<Output = hyper::Result<()>> + Send + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, version, "outbound connection ended");
        }
    });
}

/// Whether a kept HTTP/1 connection is of no more use: closed, or ready (its last response
/// read) and idle for [`IDLE_TIMEOUT`] since.
fn http1_spent(tx: &http1::SendRequest<Full<Bytes>>, since: Instant) -> bool {
    tx.is_closed() || (tx.is_ready() && since.elapsed() >= IDLE_TIMEOUT)
}

/// Whether a kept HTTP/2 connection is of no more use: closed, or not taken for a request
/// for [`IDLE_TIMEOUT`].
fn http2_spent(tx: &http2::SendRequest<Full<Bytes>>, last_taken: Instant) -> bool {
    tx.is_closed() || last_taken.elapsed() >= IDLE_TIMEOUT
}

/// The pool key of an absolute `http`/`https` URI.
fn key_of(uri: &Uri) -> Option<PoolKey> {
    let scheme = uri.scheme()?.clone();
    if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
        return None;
    }
    Some((scheme, uri.authority()?.clone()))
}

/// An HTTP/1 request line carries the path and query only; the origin goes in `Host`
/// (RFC 9112 §3.2), added from the URI unless the caller set one (the port only when it is
/// not the scheme's default).
fn to_origin_form(req: &mut Request<Full<Bytes>>, key: &PoolKey) {
    if !req.headers().contains_key(header::HOST) {
        let (scheme, authority) = key;
        let default_port = if *scheme == Scheme::HTTPS { 443 } else { 80 };
        let host = match authority.port_u16() {
            Some(port) if port != default_port => authority.as_str(),
            _ => authority.host(),
        };
        if let Ok(v) = HeaderValue::from_str(host) {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    let path = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(path);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // test code

    use std::sync::atomic::{AtomicUsize, Ordering};

    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

    use super::*;

    /// A test CA's certificate, and a `localhost` server certificate it signed with that
    /// certificate's PKCS#8 key, all DER, made by the `openssl` command line in `dir`.
    fn localhost_cert(
        dir: &std::path::Path,
    ) -> (
        CertificateDer<'static>,
        CertificateDer<'static>,
        PrivateKeyDer<'static>,
    ) {
        let openssl = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .expect("openssl runs");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            &[
                &["req", "-x509"],
                &ec[..],
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                    "-subj",
                    "/CN=turnguard test CA",
                    "-days",
                    "1",
                ],
            ]
            .concat(),
        );
        openssl(
            &[
                &["req"],
                &ec[..],
                &[
                    "-keyout",
                    "key.pem",
                    "-out",
                    "leaf.csr",
                    "-subj",
                    "/CN=localhost",
                ],
            ]
            .concat(),
        );
        std::fs::write(
            dir.join("leaf.ext"),
            "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "leaf.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "leaf.ext",
            "-outform",
            "DER",
            "-out",
            "leaf.der",
        ]);
        openssl(&["x509", "-in", "ca.pem", "-outform", "DER", "-out", "ca.der"]);
        openssl(&[
            "pkcs8", "-topk8", "-nocrypt", "-in", "key.pem", "-outform", "DER", "-out", "key.der",
        ]);
        let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
        let key = PrivatePkcs8KeyDer::from(read("key.der"));
        (
            CertificateDer::from(read("ca.der")),
            CertificateDer::from(read("leaf.der")),
            key.into(),
        )
    }

    /// An HTTPS origin whose ALPN picks `h2`, over real sockets: requests go out as HTTP/2
    /// with their path, and every request after the first (four of them at once among
    /// them) rides the one connection the first opened.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_origin_that_picks_http2_gets_one_shared_connection() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key) = localhost_cert(dir.path());
        let provider = || Arc::new(rustls::crypto::ring::default_provider());
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .unwrap();
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                        let body = format!("{:?} {}", req.version(), req.uri().path());
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                            body,
                        ))))
                    });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });

        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca).unwrap();
        let tls = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let client = with_tls(
            &Config::default(),
            hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls),
        );
        let get = |i: usize| {
            let client = client.clone();
            async move {
                let req = Request::get(format!("https://localhost:{port}/v1/r{i}"))
                    .body(Full::default())
                    .unwrap();
                let resp = client.request(req).await.unwrap();
                assert_eq!(resp.status(), 200);
                assert_eq!(resp.version(), http::Version::HTTP_2);
                let body = crate::body::read_capped(resp.into_body(), 1 << 10)
                    .await
                    .unwrap();
                assert_eq!(body, format!("HTTP/2.0 /v1/r{i}"));
            }
        };
        get(0).await;
        let at_once: Vec<_> = (1..5).map(|i| tokio::spawn(get(i))).collect();
        for t in at_once {
            t.await.unwrap();
        }
        get(5).await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "six requests, one connection"
        );
    }
}
