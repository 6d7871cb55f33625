//! Where the journal lives: a SQLite file (the embedded default) or a PostgreSQL database
//! shared by every replica (issue 15; DESIGN.md §8).

use std::fmt;
use std::path::{Path, PathBuf};

/// The journal's location, from `--journal` / `TURNGUARD_JOURNAL` / `journal =` in the file.
///
/// A value starting with `postgres://` or `postgresql://` selects PostgreSQL (the libpq URL
/// form: `postgres://user:password@host:port/db?sslmode=require`); anything else is a SQLite
/// file path. `Display` and `Debug` never show a password (the URL's userinfo password is
/// replaced by `***`), so the location can be logged and shown on `/config`.
#[derive(Clone, PartialEq, Eq)]
pub enum JournalLocation {
    /// A SQLite file (created if absent).
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL.
    Postgres(String),
}

impl JournalLocation {
    /// Parses a flag, env or file value (see the type's docs). Never fails: a value that is not
    /// a PostgreSQL URL is a path, and a bad path fails when the journal opens.
    pub fn parse(value: &str) -> Self {
        let lower = value.get(..13).unwrap_or(value).to_ascii_lowercase();
        if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
            JournalLocation::Postgres(value.to_owned())
        } else {
            JournalLocation::Sqlite(PathBuf::from(value))
        }
    }

    /// The SQLite file, or `None` for PostgreSQL.
    pub fn sqlite_path(&self) -> Option<&Path> {
        match self {
            JournalLocation::Sqlite(p) => Some(p),
            JournalLocation::Postgres(_) => None,
        }
    }
}

impl From<PathBuf> for JournalLocation {
    fn from(p: PathBuf) -> Self {
        match p.to_str() {
            Some(s) => JournalLocation::parse(s),
            None => JournalLocation::Sqlite(p),
        }
    }
}

impl From<&Path> for JournalLocation {
    fn from(p: &Path) -> Self {
        JournalLocation::from(p.to_path_buf())
    }
}

impl std::str::FromStr for JournalLocation {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(JournalLocation::parse(s))
    }
}

impl fmt::Display for JournalLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalLocation::Sqlite(p) => write!(f, "{}", p.display()),
            JournalLocation::Postgres(url) => f.write_str(&without_password(url)),
        }
    }
}

/// Serialized as its [`Display`](fmt::Display) form (no password), for `/config`.
impl serde::Serialize for JournalLocation {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Debug for JournalLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalLocation::Sqlite(p) => f.debug_tuple("Sqlite").field(p).finish(),
            JournalLocation::Postgres(_) => f
                .debug_tuple("Postgres")
                .field(&without_password(&self.to_string()))
                .finish(),
        }
    }
}

/// `scheme://user:secret@host/…` → `scheme://user:***@host/…`; a `password=` query parameter
/// is masked too. A URL without a password is returned unchanged.
fn without_password(url: &str) -> String {
    let mut out = match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            let masked: Vec<(String, String)> = u
                .query_pairs()
                .map(|(k, v)| {
                    let v = if k.eq_ignore_ascii_case("password") {
                        "***".to_owned()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            if !masked.is_empty() {
                u.query_pairs_mut().clear().extend_pairs(masked);
            }
            u.to_string()
        }
        // Not a URL we can parse: show only the scheme, never the rest.
        Err(_) => format!("{}://…", url.split("://").next().unwrap_or("postgres")),
    };
    if out.is_empty() {
        out.push_str("postgres://…");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_urls_select_postgres_and_paths_select_sqlite() {
        assert!(matches!(
            JournalLocation::parse("postgres://tg@db/turnguard"),
            JournalLocation::Postgres(_)
        ));
        assert!(matches!(
            JournalLocation::parse("PostgreSQL://tg@db/turnguard"),
            JournalLocation::Postgres(_)
        ));
        assert_eq!(
            JournalLocation::parse("./turnguard.db"),
            JournalLocation::Sqlite(PathBuf::from("./turnguard.db"))
        );
    }

    #[test]
    fn no_password_is_ever_displayed() {
        let l = JournalLocation::parse(
            "postgres://tg:s3cret@db:5432/tg?password=other&sslmode=require",
        );
        for shown in [l.to_string(), format!("{l:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(!shown.contains("other"), "{shown}");
            assert!(shown.contains("db:5432"), "{shown}");
        }
        let bad = JournalLocation::parse("postgres://tg:s3cret@[bad");
        assert!(!bad.to_string().contains("s3cret"));
    }
}
