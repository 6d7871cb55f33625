//! Policy bundle IO: reading a bundle directory, the embedded default bundle, and hot reload
//! (directory watch, debounced, plus SIGHUP). A reload compiles on the side and swaps the
//! whole snapshot; a bad edit keeps the last good bundle and is reported (log + metric).
//! `crate::policy` itself does no IO.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::metrics::Metrics;
use crate::policy::{self, BundleSource, CompiledPolicy, PolicyError};

/// Largest bundle file read, bytes.
const MAX_FILE_BYTES: u64 = 4 << 20;
/// Most files read from one bundle.
const MAX_FILES: usize = 2048;

/// The default bundle shipped in the binary: the repository's `policy/` directory (its
/// `examples/` are not part of it). The shipped catalogs (`catalogs/*.toml`) are
/// [`crate::policy::catalogs::SHIPPED`].
const EMBEDDED: &[(&str, &str)] = &[
    ("turnguard.toml", include_str!("../policy/turnguard.toml")),
    (
        "rules/default.cedar",
        include_str!("../policy/rules/default.cedar"),
    ),
    (
        "tests/cases.toml",
        include_str!("../policy/tests/cases.toml"),
    ),
    (
        "tests/claude-code-after-bash-request.json",
        include_str!("../policy/tests/claude-code-after-bash-request.json"),
    ),
    (
        "tests/claude-code-after-webfetch-request.json",
        include_str!("../policy/tests/claude-code-after-webfetch-request.json"),
    ),
    (
        "tests/claude-code-write-response.json",
        include_str!("../policy/tests/claude-code-write-response.json"),
    ),
    (
        "tests/claude-code-bash-response.json",
        include_str!("../policy/tests/claude-code-bash-response.json"),
    ),
];

/// Why a bundle could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file or directory could not be read.
    #[error("{path}: {reason}")]
    Read { path: PathBuf, reason: String },
    /// The bundle does not compile.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<PolicyError>),
}

/// The embedded default bundle, with the shipped catalogs as its `catalogs/*.toml`.
pub fn embedded() -> BundleSource {
    let catalogs = crate::policy::catalogs::SHIPPED
        .iter()
        .map(|(n, t)| (format!("catalogs/{n}.toml"), (*t).to_owned()));
    BundleSource {
        origin: "embedded".into(),
        files: EMBEDDED
            .iter()
            .map(|(p, t)| ((*p).to_owned(), (*t).to_owned()))
            .chain(catalogs)
            .collect(),
        catalogs: None,
    }
}

/// Reads every file of a bundle directory (bundle-relative paths with `/`), skipping hidden
/// files and editor leftovers (`~`, `.swp`).
pub fn read_dir(dir: &Path) -> Result<BundleSource, LoadError> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| LoadError::Read {
            path: d.clone(),
            reason: e.to_string(),
        })?;
        for entry in entries {
            let entry = entry.map_err(|e| LoadError::Read {
                path: d.clone(),
                reason: e.to_string(),
            })?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name.ends_with('~') || name.ends_with(".swp") {
                continue; // hidden (Kubernetes ConfigMap `..data` links included) or editor files
            }
            let meta = std::fs::metadata(&path).map_err(|e| LoadError::Read {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            if meta.is_dir() {
                stack.push(path);
                continue;
            }
            if meta.len() > MAX_FILE_BYTES {
                return Err(LoadError::Read {
                    path,
                    reason: format!("larger than {MAX_FILE_BYTES} bytes"),
                });
            }
            if files.len() >= MAX_FILES {
                return Err(LoadError::Read {
                    path: dir.to_owned(),
                    reason: format!("more than {MAX_FILES} files"),
                });
            }
            let text = std::fs::read_to_string(&path).map_err(|e| LoadError::Read {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            let rel = path
                .strip_prefix(dir)
                .map(|p| {
                    p.components()
                        .map(|c| c.as_os_str().to_string_lossy())
                        .collect::<Vec<_>>()
                        .join("/")
                })
                .unwrap_or(name);
            files.insert(rel, text);
        }
    }
    Ok(BundleSource {
        origin: dir.display().to_string(),
        files,
        catalogs: None,
    })
}

/// Loads and compiles the bundle at `dir`; a directory that does not exist means the
/// embedded default bundle.
pub fn load(dir: &Path) -> Result<CompiledPolicy, LoadError> {
    load_from(dir, true, None)
}

/// Loads the bundle at `dir`. Only with `allow_embedded` does a missing directory mean the
/// embedded default bundle; otherwise (a path the operator configured) it is an error, so a
/// mistyped `--policy` never silently runs the default bundle. `catalogs` is the serve
/// setting `catalog` (replaces the bundle's `catalogs` list when set).
pub fn load_from(
    dir: &Path,
    allow_embedded: bool,
    catalogs: Option<&[String]>,
) -> Result<CompiledPolicy, LoadError> {
    let mut src = if dir.exists() {
        read_dir(dir)?
    } else if allow_embedded {
        embedded()
    } else {
        return Err(LoadError::Read {
            path: dir.to_owned(),
            reason: "no such directory (the embedded default bundle is used only when --policy is not set)".into(),
        });
    };
    src.catalogs = catalogs.map(<[String]>::to_vec);
    policy::compile(&src).map_err(LoadError::Invalid)
}

/// The active policy snapshot, swapped whole on reload.
pub struct PolicyHandle {
    current: ArcSwap<CompiledPolicy>,
    dir: PathBuf,
    allow_embedded: bool,
    catalogs: Option<Vec<String>>,
}

impl PolicyHandle {
    /// Wraps the first compiled bundle.
    pub fn new(policy: CompiledPolicy, dir: PathBuf) -> Self {
        Self {
            current: ArcSwap::from_pointee(policy),
            dir,
            allow_embedded: true,
            catalogs: None,
        }
    }

    /// The serve setting `catalog`, applied on every reload as at start.
    pub fn with_catalogs(mut self, catalogs: Option<Vec<String>>) -> Self {
        self.catalogs = catalogs;
        self
    }

    /// Whether a missing directory means the embedded bundle on reload (as at start).
    pub fn with_embedded_fallback(mut self, allow: bool) -> Self {
        self.allow_embedded = allow;
        self
    }

    /// The snapshot a request uses from start to end.
    pub fn snapshot(&self) -> Arc<CompiledPolicy> {
        self.current.load_full()
    }

    /// Recompiles the bundle and swaps it in; on error the last good bundle stays.
    pub fn reload(&self, metrics: &Metrics) -> Result<String, LoadError> {
        match load_from(&self.dir, self.allow_embedded, self.catalogs.as_deref()) {
            Ok(p) => {
                let revision = p.revision.clone();
                let old = self.current.load().revision.clone();
                self.current.store(Arc::new(p));
                metrics.policy_reload(crate::metrics::ReloadResult::Ok);
                metrics.policy_revision(&old, &revision);
                tracing::info!(revision = %revision, previous = %old, "policy bundle reloaded");
                Ok(revision)
            }
            Err(e) => {
                metrics.policy_reload(crate::metrics::ReloadResult::Error);
                tracing::error!(error = %e, kept = %self.current.load().revision, "policy reload failed; keeping the last good bundle");
                Err(e)
            }
        }
    }
}

/// Watches the bundle directory (debounced) and SIGHUP, reloading on either. Runs until the
/// returned task is aborted.
pub fn watch(
    handle: Arc<PolicyHandle>,
    metrics: Arc<Metrics>,
    debounce: Duration,
) -> tokio::task::JoinHandle<()> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(16);
    let dir = handle.dir.clone();
    let watcher = {
        let tx = tx.clone();
        let mut w = match notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            // Only changes count: the reload itself reads every file, and reads (`Access`
            // events: open, close-no-write) must not trigger another reload.
            if res.is_ok_and(|e| is_change(&e.kind)) {
                let _ = tx.try_send(());
            }
        }) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the policy directory; SIGHUP still reloads");
                None
            }
        };
        if let Some(w) = w.as_mut() {
            use notify::Watcher;
            if dir.exists() {
                if let Err(e) = w.watch(&dir, notify::RecursiveMode::Recursive) {
                    tracing::warn!(error = %e, dir = %dir.display(), "cannot watch the policy directory; SIGHUP still reloads");
                }
            }
        }
        w
    };
    #[cfg(unix)]
    {
        let tx = tx.clone();
        tokio::spawn(async move {
            if let Ok(mut hup) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            {
                while hup.recv().await.is_some() {
                    if tx.send(()).await.is_err() {
                        break;
                    }
                }
            }
        });
    }
    tokio::spawn(async move {
        let _keep = watcher;
        while rx.recv().await.is_some() {
            // Editors and Kubernetes replace files by rename: wait for the burst to settle.
            tokio::time::sleep(debounce).await;
            while rx.try_recv().is_ok() {}
            let h = Arc::clone(&handle);
            let m = Arc::clone(&metrics);
            let _ = tokio::task::spawn_blocking(move || h.reload(&m)).await;
        }
    })
}

/// A filesystem event that can change the bundle: a create, a write, a rename or a removal
/// (editors and Kubernetes replace files by rename), not a read.
fn is_change(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match kind {
        EventKind::Create(_) | EventKind::Modify(_) | EventKind::Remove(_) => true,
        // A writer closing the file is the end of a write.
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) | EventKind::Other | EventKind::Any => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_do_not_count_as_changes() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, EventKind, ModifyKind, RenameMode,
        };
        assert!(!is_change(&EventKind::Access(AccessKind::Open(
            AccessMode::Read
        ))));
        assert!(!is_change(&EventKind::Access(AccessKind::Close(
            AccessMode::Read
        ))));
        assert!(is_change(&EventKind::Access(AccessKind::Close(
            AccessMode::Write
        ))));
        assert!(is_change(&EventKind::Modify(ModifyKind::Name(
            RenameMode::To
        ))));
        assert!(is_change(&EventKind::Create(CreateKind::File)));
    }

    #[test]
    fn the_embedded_bundle_is_the_repository_bundle_and_compiles() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("policy");
        let on_disk = read_dir(&dir).unwrap();
        let emb = embedded();
        let disk_files: Vec<&String> = on_disk
            .files
            .keys()
            .filter(|k| {
                !k.ends_with(".md") && !k.ends_with(".schema.json") && !k.starts_with("examples/")
            })
            .collect();
        let emb_files: Vec<&String> = emb.files.keys().collect();
        assert_eq!(
            disk_files, emb_files,
            "EMBEDDED must list every bundle file"
        );
        for (k, v) in &emb.files {
            assert_eq!(&on_disk.files[k], v, "{k}");
        }
        if let Err(e) = policy::compile(&emb) {
            panic!(
                "{}",
                e.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}
