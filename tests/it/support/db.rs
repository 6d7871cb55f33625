//! The journal backend the suite runs on, and a read-side SQL handle that works on both.
//!
//! `TURNGUARD_TEST_BACKEND=postgres` (with `TURNGUARD_TEST_PG`, an admin URL of a throwaway
//! PostgreSQL cluster, e.g. `postgres://postgres@127.0.0.1:5433/postgres`) runs every harness
//! on its own fresh PostgreSQL database; unset (or `sqlite`), on a SQLite file. A harness
//! directory always names its journal `DIR/journal.db`; on PostgreSQL the file
//! `DIR/journal.pg-url` beside it holds the database's URL, so a restart on the same directory
//! is a restart on the same database, and [`journal`](super::journal) opens the right one.
//!
//! [`Db`] is the tests' window into the journal's tables: the subset of rusqlite's API the
//! suite uses (`query_row`, `prepare` + `query_map`, `execute`, `optional`), answered by
//! SQLite or by PostgreSQL. The tables and columns are the same on both backends (the
//! PostgreSQL schema keeps SQLite's names; integers are `BIGINT`), so a test's SQL runs on
//! both; placeholders (`?1`, `?`) become literals on PostgreSQL, and each test database gets
//! the two SQLite functions the suite's SQL uses (`instr`, `json_extract`).

use std::path::{Path, PathBuf};

/// Which journal backend this run of the suite uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The backend from `TURNGUARD_TEST_BACKEND` (`sqlite` when unset). Panics on an unknown name
/// or on `postgres` without `TURNGUARD_TEST_PG`, so a misconfigured run never silently tests
/// the other backend.
pub fn backend() -> Backend {
    match std::env::var("TURNGUARD_TEST_BACKEND").as_deref() {
        Err(_) | Ok("") | Ok("sqlite") => Backend::Sqlite,
        Ok("postgres") => {
            assert!(
                std::env::var("TURNGUARD_TEST_PG").is_ok(),
                "TURNGUARD_TEST_BACKEND=postgres needs TURNGUARD_TEST_PG (an admin URL)"
            );
            Backend::Postgres
        }
        Ok(other) => panic!("TURNGUARD_TEST_BACKEND={other}: not `sqlite` or `postgres`"),
    }
}

/// `true` (and a notice on stderr) when the suite runs on PostgreSQL: for the few tests about
/// the SQLite file itself (its locks, a full disk under it, its integrity check); their
/// PostgreSQL counterparts are in `journal_postgres`.
pub fn sqlite_only(test: &str) -> bool {
    if backend() == Backend::Postgres {
        eprintln!("{test}: about the SQLite file itself; skipped on the PostgreSQL backend");
        true
    } else {
        false
    }
}

const PG_URL_FILE: &str = "journal.pg-url";

/// The `--journal` value for a harness journal `DIR/journal.db`: that path on SQLite, or on
/// PostgreSQL the URL of the directory's own database (created on first use).
pub fn journal_arg(journal: &Path) -> String {
    match backend() {
        Backend::Sqlite => journal.display().to_string(),
        Backend::Postgres => pg_database_for(journal.parent().expect("DIR/journal.db")),
    }
}

/// The URL of `dir`'s own PostgreSQL database: read from `DIR/journal.pg-url`, or a new
/// database `tg_<uuid>` created on the cluster `TURNGUARD_TEST_PG` names (with the SQLite
/// compatibility functions) and written there.
pub fn pg_database_for(dir: &Path) -> String {
    let file = dir.join(PG_URL_FILE);
    if let Ok(url) = std::fs::read_to_string(&file) {
        return url.trim().to_owned();
    }
    let admin = std::env::var("TURNGUARD_TEST_PG").expect("TURNGUARD_TEST_PG");
    let name = format!("tg_{}", uuid::Uuid::new_v4().simple());
    let mut url = url::Url::parse(&admin).expect("TURNGUARD_TEST_PG is a URL");
    url.set_path(&format!("/{name}"));
    let url = url.to_string();
    let (admin2, url2, name2) = (admin.clone(), url.clone(), name.clone());
    on_thread(move || {
        let mut c = postgres::Client::connect(&admin2, postgres::NoTls)
            .map_err(|e| format!("connect {admin2}: {e}"))?;
        c.batch_execute(&format!("CREATE DATABASE {name2}"))
            .map_err(|e| e.to_string())?;
        let mut d = postgres::Client::connect(&url2, postgres::NoTls)
            .map_err(|e| format!("connect {url2}: {e}"))?;
        d.batch_execute(
            "CREATE FUNCTION instr(a text, b text) RETURNS integer
                 LANGUAGE sql IMMUTABLE AS $$ SELECT strpos(a, b) $$;
             CREATE FUNCTION json_extract(doc text, path text) RETURNS text
                 LANGUAGE sql IMMUTABLE AS $$
                   SELECT CASE jsonb_typeof(v) WHEN 'string' THEN v #>> '{}' ELSE v::text END
                   FROM (SELECT jsonb_path_query_first(doc::jsonb, path::jsonpath) AS v) s $$;",
        )
        .map_err(|e| e.to_string())
    })
    .unwrap_or_else(|e| panic!("cannot create test database {name}: {e}"));
    std::fs::write(&file, &url).expect("write journal.pg-url");
    url
}

/// Runs `f` on its own thread (the sync PostgreSQL client starts a runtime of its own, which
/// cannot nest in the test's).
fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().expect("database thread")
}

/// A value read from, or bound into, a journal query.
#[derive(Debug, Clone, PartialEq)]
pub enum DbValue {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

/// Why a journal query failed.
#[derive(Debug)]
pub enum DbError {
    /// `query_row` found no row (see [`OptionalExtension::optional`]).
    NoRows,
    /// The database refused the statement.
    Sql(String),
    /// A column could not be read as the type asked for.
    Type {
        column: String,
        want: &'static str,
        got: DbValue,
    },
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DbError::NoRows => f.write_str("query returned no rows"),
            DbError::Sql(e) => f.write_str(e),
            DbError::Type { column, want, got } => {
                write!(f, "column {column}: want {want}, got {got:?}")
            }
        }
    }
}

impl std::error::Error for DbError {}

/// rusqlite's `OptionalExtension`, for [`Db::query_row`].
pub trait OptionalExtension<T> {
    fn optional(self) -> Result<Option<T>, DbError>;
}

impl<T> OptionalExtension<T> for Result<T, DbError> {
    fn optional(self) -> Result<Option<T>, DbError> {
        match self {
            Ok(v) => Ok(Some(v)),
            Err(DbError::NoRows) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A Rust value a column can be read as.
pub trait FromDb: Sized {
    const NAME: &'static str;
    fn from_db(v: &DbValue) -> Option<Self>;
}

impl FromDb for String {
    const NAME: &'static str = "text";
    fn from_db(v: &DbValue) -> Option<Self> {
        match v {
            DbValue::Text(s) => Some(s.clone()),
            DbValue::Blob(b) => String::from_utf8(b.clone()).ok(),
            _ => None,
        }
    }
}

impl FromDb for Vec<u8> {
    const NAME: &'static str = "blob";
    fn from_db(v: &DbValue) -> Option<Self> {
        match v {
            DbValue::Blob(b) => Some(b.clone()),
            // PostgreSQL's JSON form of a `bytea` is its hex text.
            DbValue::Text(s) => match s.strip_prefix("\\x") {
                Some(h) => hex::decode(h).ok(),
                None => Some(s.clone().into_bytes()),
            },
            _ => None,
        }
    }
}

impl FromDb for f64 {
    const NAME: &'static str = "real";
    fn from_db(v: &DbValue) -> Option<Self> {
        match v {
            DbValue::Real(x) => Some(*x),
            DbValue::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
}

impl FromDb for bool {
    const NAME: &'static str = "bool";
    fn from_db(v: &DbValue) -> Option<Self> {
        match v {
            DbValue::Int(i) => Some(*i != 0),
            _ => None,
        }
    }
}

macro_rules! from_db_int {
    ($($t:ty),*) => {$(
        impl FromDb for $t {
            const NAME: &'static str = stringify!($t);
            fn from_db(v: &DbValue) -> Option<Self> {
                match v {
                    DbValue::Int(i) => <$t>::try_from(*i).ok(),
                    _ => None,
                }
            }
        }
    )*};
}
from_db_int!(i64, i32, u32, u64, usize);

impl<T: FromDb> FromDb for Option<T> {
    const NAME: &'static str = T::NAME;
    fn from_db(v: &DbValue) -> Option<Self> {
        match v {
            DbValue::Null => Some(None),
            v => T::from_db(v).map(Some),
        }
    }
}

/// A Rust value bound to a placeholder.
pub trait ToDb {
    fn to_db(&self) -> DbValue;
}

impl ToDb for str {
    fn to_db(&self) -> DbValue {
        DbValue::Text(self.to_owned())
    }
}
impl ToDb for String {
    fn to_db(&self) -> DbValue {
        DbValue::Text(self.clone())
    }
}
impl ToDb for DbValue {
    fn to_db(&self) -> DbValue {
        self.clone()
    }
}
impl ToDb for bool {
    fn to_db(&self) -> DbValue {
        DbValue::Int(i64::from(*self))
    }
}
macro_rules! to_db_int {
    ($($t:ty),*) => {$(
        impl ToDb for $t {
            fn to_db(&self) -> DbValue {
                DbValue::Int(i64::try_from(*self).expect("an i64"))
            }
        }
    )*};
}
to_db_int!(i64, i32, u32, u64, usize);
impl<T: ToDb + ?Sized> ToDb for &T {
    fn to_db(&self) -> DbValue {
        (**self).to_db()
    }
}
impl<T: ToDb> ToDb for Option<T> {
    fn to_db(&self) -> DbValue {
        match self {
            Some(v) => v.to_db(),
            None => DbValue::Null,
        }
    }
}

/// A statement's parameters: `[]`, `[a, b]` (one type), `&[&a as &dyn ToDb, &b]`, or a
/// `Vec<DbValue>`.
pub trait DbParams {
    fn values(self) -> Vec<DbValue>;
}

impl DbParams for [&dyn ToDb; 0] {
    fn values(self) -> Vec<DbValue> {
        Vec::new()
    }
}
impl DbParams for &[&dyn ToDb] {
    fn values(self) -> Vec<DbValue> {
        self.iter().map(|v| v.to_db()).collect()
    }
}
impl DbParams for Vec<DbValue> {
    fn values(self) -> Vec<DbValue> {
        self
    }
}
macro_rules! params_array {
    ($($n:literal),*) => {$(
        impl<T: ToDb> DbParams for [T; $n] {
            fn values(self) -> Vec<DbValue> {
                self.iter().map(ToDb::to_db).collect()
            }
        }
    )*};
}
params_array!(1, 2, 3, 4, 5, 6, 7, 8);

/// Which column of a [`Row`]: its index or its name.
pub trait ColIndex {
    fn index(&self, row: &Row) -> Result<usize, DbError>;
}
impl ColIndex for usize {
    fn index(&self, row: &Row) -> Result<usize, DbError> {
        if *self < row.values.len() {
            Ok(*self)
        } else {
            Err(DbError::Sql(format!("no column {self}")))
        }
    }
}
impl ColIndex for &str {
    fn index(&self, row: &Row) -> Result<usize, DbError> {
        row.names
            .iter()
            .position(|n| n == self)
            .ok_or_else(|| DbError::Sql(format!("no column {self}")))
    }
}

/// One result row.
#[derive(Debug, Clone)]
pub struct Row {
    names: Vec<String>,
    values: Vec<DbValue>,
}

impl Row {
    /// Column `i` as a `T` (rusqlite's `Row::get`).
    pub fn get<I: ColIndex, T: FromDb>(&self, i: I) -> Result<T, DbError> {
        let at = i.index(self)?;
        let v = &self.values[at];
        T::from_db(v).ok_or_else(|| DbError::Type {
            column: self.names[at].clone(),
            want: T::NAME,
            got: v.clone(),
        })
    }
    /// Every column's value, in order.
    pub fn values(&self) -> &[DbValue] {
        &self.values
    }
}

/// A read (and, for tests that tamper with the journal, write) handle on a journal.
pub enum Db {
    Sqlite(rusqlite::Connection),
    Postgres(String),
}

impl Db {
    /// The journal at `path` (`DIR/journal.db`): PostgreSQL when `DIR/journal.pg-url` exists,
    /// else the SQLite file, opened read-only.
    pub fn open(path: &Path) -> Db {
        let pg = path
            .parent()
            .map(|d| d.join(PG_URL_FILE))
            .filter(|f| path.file_name().is_some_and(|n| n == "journal.db") && f.exists());
        match pg {
            Some(f) => Db::Postgres(
                std::fs::read_to_string(f)
                    .expect("pg url")
                    .trim()
                    .to_owned(),
            ),
            None => Db::Sqlite(
                rusqlite::Connection::open_with_flags(
                    path,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                )
                .expect("journal opens"),
            ),
        }
    }

    /// Like [`Db::open`], read-write (SQLite), for tests that tamper with the journal.
    pub fn open_rw(path: &Path) -> Db {
        match Db::open(path) {
            Db::Sqlite(_) => {
                let c = rusqlite::Connection::open(path).expect("journal opens");
                c.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
                Db::Sqlite(c)
            }
            pg => pg,
        }
    }

    /// Which backend this handle reads.
    pub fn backend(&self) -> Backend {
        match self {
            Db::Sqlite(_) => Backend::Sqlite,
            Db::Postgres(_) => Backend::Postgres,
        }
    }

    /// All rows of `sql` with `params`.
    pub fn rows(&self, sql: &str, params: impl DbParams) -> Result<Vec<Row>, DbError> {
        let params = params.values();
        match self {
            Db::Sqlite(c) => sqlite_rows(c, sql, &params),
            Db::Postgres(url) => pg_rows(url, sql, &params),
        }
    }

    /// The first row of `sql`, mapped by `f`; [`DbError::NoRows`] when there is none.
    pub fn query_row<T>(
        &self,
        sql: &str,
        params: impl DbParams,
        f: impl FnOnce(&Row) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let rows = self.rows(sql, params)?;
        f(rows.first().ok_or(DbError::NoRows)?)
    }

    /// The first column of every row of `sql` (a query without parameters), each read as `T`;
    /// panics, naming the query, when it fails or a value is not a `T` (test code).
    pub fn column<T: FromDb>(&self, sql: &str) -> Vec<T> {
        let rows = self.rows(sql, []).unwrap_or_else(|e| panic!("{sql}: {e}"));
        rows.iter()
            .map(|r| r.get(0).unwrap_or_else(|e| panic!("{sql}: {e}")))
            .collect()
    }

    /// A statement to run with [`Statement::query_map`].
    pub fn prepare(&self, sql: &str) -> Result<Statement<'_>, DbError> {
        Ok(Statement {
            db: self,
            sql: sql.to_owned(),
        })
    }

    /// Runs a statement that returns no rows; the number of rows it changed.
    pub fn execute(&self, sql: &str, params: impl DbParams) -> Result<usize, DbError> {
        let params = params.values();
        match self {
            Db::Sqlite(c) => {
                let bound: Vec<rusqlite::types::Value> = params.iter().map(to_sqlite).collect();
                c.execute(sql, rusqlite::params_from_iter(bound))
                    .map_err(|e| DbError::Sql(e.to_string()))
            }
            Db::Postgres(url) => {
                let (url, sql) = (url.clone(), inline(sql, &params));
                on_thread(move || {
                    let mut c = postgres::Client::connect(&url, postgres::NoTls)
                        .map_err(|e| DbError::Sql(e.to_string()))?;
                    c.execute(sql.as_str(), &[])
                        .map(|n| n as usize)
                        .map_err(|e| DbError::Sql(e.to_string()))
                })
            }
        }
    }

    /// SQLite: `PRAGMA integrity_check` (`"ok"` when the file is whole). PostgreSQL (whose
    /// crash safety is its own WAL): every journal table reads back in full, else the first
    /// error.
    pub fn check_integrity(&self) -> String {
        match self {
            Db::Sqlite(_) => self
                .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                .unwrap_or_else(|e| e.to_string()),
            Db::Postgres(_) => {
                for t in self.tables() {
                    if let Err(e) = self.rows(&format!("SELECT * FROM \"{t}\""), []) {
                        return format!("{t}: {e}");
                    }
                }
                "ok".to_owned()
            }
        }
    }

    /// The journal's table names.
    pub fn tables(&self) -> Vec<String> {
        let sql = match self {
            Db::Sqlite(_) => "SELECT name FROM sqlite_master WHERE type = 'table'",
            Db::Postgres(_) => {
                "SELECT table_name AS name FROM information_schema.tables
                 WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
            }
        };
        self.rows(sql, [])
            .unwrap()
            .iter()
            .map(|r| r.get(0).unwrap())
            .collect()
    }

    /// Every stored cell of `table` as (column, bytes): text and blobs as they are, numbers
    /// in decimal; for scans that no secret is anywhere in the journal.
    pub fn cells(&self, table: &str) -> Vec<(String, Vec<u8>)> {
        let rows = self
            .rows(&format!("SELECT * FROM \"{table}\""), [])
            .unwrap_or_else(|e| panic!("read {table}: {e}"));
        let mut out = Vec::new();
        for r in rows {
            for (name, v) in r.names.into_iter().zip(r.values) {
                let bytes = match v {
                    DbValue::Null => continue,
                    DbValue::Int(i) => i.to_string().into_bytes(),
                    DbValue::Real(x) => x.to_string().into_bytes(),
                    DbValue::Text(s) => match s.strip_prefix("\\x").map(hex::decode) {
                        Some(Ok(b)) => b,
                        _ => s.into_bytes(),
                    },
                    DbValue::Blob(b) => b,
                };
                out.push((name, bytes));
            }
        }
        out
    }
}

/// A prepared statement (rusqlite's shape: `db.prepare(sql)?.query_map(params, f)`).
pub struct Statement<'a> {
    db: &'a Db,
    sql: String,
}

impl Statement<'_> {
    /// Every row mapped by `f`.
    pub fn query_map<T>(
        &mut self,
        params: impl DbParams,
        f: impl FnMut(&Row) -> Result<T, DbError>,
    ) -> Result<std::vec::IntoIter<Result<T, DbError>>, DbError> {
        let rows = self.db.rows(&self.sql, params)?;
        Ok(rows.iter().map(f).collect::<Vec<_>>().into_iter())
    }
}

fn to_sqlite(v: &DbValue) -> rusqlite::types::Value {
    use rusqlite::types::Value;
    match v {
        DbValue::Null => Value::Null,
        DbValue::Int(i) => Value::Integer(*i),
        DbValue::Real(x) => Value::Real(*x),
        DbValue::Text(s) => Value::Text(s.clone()),
        DbValue::Blob(b) => Value::Blob(b.clone()),
    }
}

fn sqlite_rows(
    c: &rusqlite::Connection,
    sql: &str,
    params: &[DbValue],
) -> Result<Vec<Row>, DbError> {
    use rusqlite::types::ValueRef;
    let err = |e: rusqlite::Error| DbError::Sql(e.to_string());
    let mut st = c.prepare(sql).map_err(err)?;
    let names: Vec<String> = st.column_names().iter().map(|s| s.to_string()).collect();
    let bound: Vec<rusqlite::types::Value> = params.iter().map(to_sqlite).collect();
    let mut rows = st.query(rusqlite::params_from_iter(bound)).map_err(err)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next().map_err(err)? {
        let values = (0..names.len())
            .map(|i| {
                Ok(match r.get_ref(i)? {
                    ValueRef::Null => DbValue::Null,
                    ValueRef::Integer(i) => DbValue::Int(i),
                    ValueRef::Real(x) => DbValue::Real(x),
                    ValueRef::Text(t) => DbValue::Text(String::from_utf8_lossy(t).into_owned()),
                    ValueRef::Blob(b) => DbValue::Blob(b.to_vec()),
                })
            })
            .collect::<Result<Vec<_>, rusqlite::Error>>()
            .map_err(err)?;
        out.push(Row {
            names: names.clone(),
            values,
        });
    }
    Ok(out)
}

/// A query on PostgreSQL: placeholders inlined as literals, each row read back as
/// `row_to_json` (column order kept; any column type, `numeric` sums included).
fn pg_rows(url: &str, sql: &str, params: &[DbValue]) -> Result<Vec<Row>, DbError> {
    let inner = inline(sql, params);
    let url = url.to_owned();
    let (names, texts): (Vec<String>, Vec<String>) = on_thread(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls)
            .map_err(|e| DbError::Sql(e.to_string()))?;
        // The statement's own column names, then the rows under positional aliases (two
        // columns may share a name, which a JSON object could not keep apart).
        let names: Vec<String> = c
            .prepare(inner.as_str())
            .map_err(|e| DbError::Sql(format!("{e:?}: {inner}")))?
            .columns()
            .iter()
            .map(|col| col.name().to_owned())
            .collect();
        let aliases: Vec<String> = (0..names.len()).map(|i| format!("c{i}")).collect();
        let wrapped = format!(
            "SELECT row_to_json(t)::text FROM ({inner}) t({})",
            aliases.join(", ")
        );
        let texts = c
            .query(wrapped.as_str(), &[])
            .map_err(|e| DbError::Sql(format!("{e:?}: {wrapped}")))?
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect();
        Ok::<_, DbError>((names, texts))
    })?;
    texts
        .iter()
        .map(|t| {
            let obj: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(t).map_err(|e| DbError::Sql(e.to_string()))?;
            let names = names.clone();
            let values = obj
                .into_iter()
                .map(|(_, v)| match v {
                    serde_json::Value::Null => DbValue::Null,
                    serde_json::Value::Bool(b) => DbValue::Int(i64::from(b)),
                    serde_json::Value::Number(n) => match n.as_i64() {
                        Some(i) => DbValue::Int(i),
                        None => DbValue::Real(n.as_f64().unwrap_or(f64::NAN)),
                    },
                    serde_json::Value::String(s) => DbValue::Text(s),
                    other => DbValue::Text(other.to_string()),
                })
                .collect();
            Ok(Row { names, values })
        })
        .collect()
}

/// `sql` with `?N` / `?` placeholders (outside string literals) replaced by `params` as SQL
/// literals (test code only: the values are the tests' own).
fn inline(sql: &str, params: &[DbValue]) -> String {
    let lit = |v: &DbValue| match v {
        DbValue::Null => "NULL".to_owned(),
        DbValue::Int(i) => i.to_string(),
        DbValue::Real(x) => format!("{x:?}"),
        DbValue::Text(s) => format!("'{}'", s.replace('\'', "''")),
        DbValue::Blob(b) => format!("'\\x{}'::bytea", hex::encode(b)),
    };
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    let (mut in_str, mut next) = (false, 0usize);
    while let Some(c) = chars.next() {
        if c == '\'' {
            in_str = !in_str;
        }
        if c != '?' || in_str {
            out.push(c);
            continue;
        }
        let mut digits = String::new();
        while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            digits.push(*d);
            chars.next();
        }
        let at = match digits.parse::<usize>() {
            Ok(n) => n - 1,
            Err(_) => next,
        };
        next = at + 1;
        out.push_str(&lit(params.get(at).unwrap_or(&DbValue::Null)));
    }
    out
}

/// The SQLite file of a harness directory, for the SQLite-only tests that read it directly.
pub fn sqlite_file(dir: &Path) -> PathBuf {
    dir.join("journal.db")
}
