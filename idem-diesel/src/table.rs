//! The table a store keeps its records in: its validated name and its DDL.
//!
//! The embedded migrations create the table under its default name. A store
//! configured with another name (or, on PostgreSQL, a schema) creates its table
//! from [`Table::postgres_ddl`] / [`Table::sqlite_ddl`] instead, because a diesel
//! migration cannot be templated; for the default name those functions yield the
//! migrations' `up.sql` byte for byte (a test checks it), so both paths build the
//! same table.

use crate::SetupError;

/// The table name stores use unless configured otherwise.
pub const DEFAULT_TABLE: &str = "idem_records";

/// The longest table name accepted: PostgreSQL's 63-byte identifier limit minus
/// the `_expires_at` suffix of the cleanup index.
const MAX_TABLE_LEN: usize = 52;

/// The longest schema name accepted (PostgreSQL's identifier limit).
const MAX_SCHEMA_LEN: usize = 63;

/// Every column the stores' statements use, in both DDLs. A table that lacks one
/// was created by an older version: [`Table::check_columns`] names them.
const COLUMNS: &[&str] = &[
    "scope",
    "key",
    "fingerprint",
    "state",
    "owner",
    "lease_until",
    "status",
    "headers",
    "body",
    "replayable",
    "expires_at",
    "created_at",
];

/// One column of the store's table, as the schema checks read the catalog.
#[derive(Debug, diesel::QueryableByName)]
pub(crate) struct ColumnRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub(crate) name: String,
}

/// What `schema` (tables, each with the columns a backend's statements
/// use) lacks in `found` (the columns the database described for each of
/// its tables, in its order; none: the table does not exist): `table` for a
/// missing table, `table.column` for a missing column.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn missing_columns(schema: &[(&str, &[&str])], found: &[Vec<ColumnRow>]) -> Vec<String> {
    let mut missing = Vec::new();
    for ((table, columns), found) in schema.iter().zip(found) {
        if found.is_empty() {
            missing.push((*table).to_owned());
            continue;
        }
        for column in columns.iter() {
            if !found.iter().any(|row| row.name == *column) {
                missing.push(format!("{table}.{column}"));
            }
        }
    }
    missing
}

/// Whether a store's table was verified in this process (its `migrate` or
/// `check_schema` succeeded), or its check explicitly skipped: what the store
/// answers [`Store::readiness`](idem_core::Store::readiness) with, so a route
/// built on a store nobody migrated fails at start-up.
#[derive(Debug, Default)]
pub(crate) struct SchemaGate {
    verified: std::sync::atomic::AtomicBool,
}

impl SchemaGate {
    /// The table was migrated or checked, or its check is skipped.
    pub(crate) fn pass(&self) {
        self.verified
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Ready once verified or skipped; otherwise the fix, named for `builder`.
    pub(crate) fn readiness(
        &self,
        table: &Table,
        builder: &str,
    ) -> Result<(), idem_core::store::NotReady> {
        self.verified_or(|| {
            format!(
                "the idempotency table {} was not verified before a route was built on its store: \
                 call `store.migrate().await` at start-up, or `store.check_schema().await` when the \
                 application's own migrations create the table (`{builder}::skip_schema_check` opts out)",
                table.display()
            )
        })
    }

    /// An inbox's: ready once verified or skipped; otherwise the fix, named
    /// for `builder`.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn inbox_readiness(&self, builder: &str) -> Result<(), idem_core::store::NotReady> {
        self.verified_or(|| {
            format!(
                "the consumer inbox's tables ({}) were not verified before a consumer started on it: \
                 call `inbox.migrate().await` at start-up, or `inbox.check_schema().await` when the \
                 application's own migrations create them (`{builder}::skip_schema_check` opts out)",
                crate::consume::INBOX_TABLES.join(", ")
            )
        })
    }

    /// An outbox's: ready once verified or skipped; otherwise the fix, named
    /// for `builder`.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn outbox_readiness(&self, builder: &str) -> Result<(), idem_core::store::NotReady> {
        self.verified_or(|| {
            format!(
                "the outbox's table ({}) was not verified before a relay started on it: \
                 call `outbox.migrate().await` at start-up, or `outbox.check_schema().await` when \
                 the application's own migrations create it (`{builder}::skip_schema_check` opts out)",
                crate::outbox::OUTBOX_TABLE
            )
        })
    }

    fn verified_or(
        &self,
        not_ready: impl FnOnce() -> String,
    ) -> Result<(), idem_core::store::NotReady> {
        if self.verified.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        Err(idem_core::store::NotReady(not_ready()))
    }
}

/// A validated table name, with an optional schema (PostgreSQL only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Table {
    schema: Option<String>,
    name: String,
}

impl Table {
    /// The table `name` in `schema` (the connection's `search_path` when `None`).
    pub(crate) fn new(schema: Option<&str>, name: &str) -> Result<Self, SetupError> {
        if let Some(schema) = schema {
            check_identifier("schema", schema, MAX_SCHEMA_LEN)?;
        }
        check_identifier("table", name, MAX_TABLE_LEN)?;
        Ok(Self {
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        })
    }

    /// Whether this is the table the embedded migrations create.
    pub(crate) fn is_default(&self) -> bool {
        self.schema.is_none() && self.name == DEFAULT_TABLE
    }

    /// The table's own name, unquoted and unqualified.
    #[cfg(feature = "sqlite")]
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Whether the table the database described (its columns; none when it
    /// does not exist) is the one this library's statements need: the start-up
    /// check behind `check_schema`, whose errors name the fix.
    pub(crate) fn check_columns(&self, found: &[ColumnRow]) -> Result<(), SetupError> {
        if found.is_empty() {
            return Err(SetupError::SchemaMissing {
                table: self.display(),
            });
        }
        let missing: Vec<String> = COLUMNS
            .iter()
            .filter(|column| !found.iter().any(|row| row.name == **column))
            .map(|column| (*column).to_owned())
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(SetupError::SchemaOutdated {
                table: self.display(),
                missing,
            })
        }
    }

    #[cfg(feature = "postgres")]
    /// The schema, if one was configured.
    pub(crate) fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table as SQL names it: quoted, schema-qualified when configured.
    pub(crate) fn sql(&self) -> String {
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{}\"", self.name),
            None => format!("\"{}\"", self.name),
        }
    }

    /// The table for people and for lock keys: `schema.name` or `name`.
    pub(crate) fn display(&self) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}", self.name),
            None => self.name.clone(),
        }
    }

    /// The cleanup index's name, quoted (an index lives in its table's schema).
    fn index(&self) -> String {
        format!("\"{}_expires_at\"", self.name)
    }

    #[cfg(feature = "postgres")]
    /// The statements that create the table and its cleanup index on PostgreSQL,
    /// if they do not exist. Does not create the schema.
    pub(crate) fn postgres_ddl(&self) -> String {
        self.ddl(
            "    scope       text        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    state       text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    owner       uuid,
    lease_until timestamptz,
    status      integer,
    headers     bytea,
    body        bytea,
    replayable  boolean,
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
",
        )
    }

    #[cfg(feature = "sqlite")]
    /// The statements that create the table and its cleanup index on SQLite, if
    /// they do not exist. Times are microseconds since the Unix epoch.
    pub(crate) fn sqlite_ddl(&self) -> String {
        self.ddl(
            "    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed')),
    owner       BLOB,
    lease_until INTEGER,
    status      INTEGER,
    headers     BLOB,
    body        BLOB,
    replayable  INTEGER,
    expires_at  INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
",
        )
    }

    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    /// The table with `columns` (each database's types), its key and checks,
    /// and its cleanup index, as both databases write them.
    fn ddl(&self, columns: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (
{columns}    PRIMARY KEY (scope, key),
    CHECK (state <> 'in_progress' OR (owner IS NOT NULL AND lease_until IS NOT NULL)),
    CHECK (state <> 'completed' OR (status IS NOT NULL AND headers IS NOT NULL
                                    AND body IS NOT NULL AND replayable IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
",
            table = self.sql(),
            index = self.index(),
        )
    }
}

impl Default for Table {
    fn default() -> Self {
        Self {
            schema: None,
            name: DEFAULT_TABLE.to_owned(),
        }
    }
}

/// Accepts names that need no escaping: they are spliced into SQL (quoted), since
/// identifiers cannot be bound as parameters.
fn check_identifier(kind: &'static str, name: &str, max: usize) -> Result<(), SetupError> {
    let mut chars = name.chars();
    let starts_well = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let rest_plain = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if starts_well && rest_plain && name.len() <= max {
        Ok(())
    } else {
        Err(SetupError::InvalidName {
            kind,
            name: name.to_owned(),
            max,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[cfg(feature = "postgres")]
    #[test]
    fn default_postgres_ddl_is_the_embedded_migration() {
        let migration =
            include_str!("../migrations/postgres/2025-06-01-000000_create_idem_records/up.sql");
        assert_eq!(Table::default().postgres_ddl(), migration);
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn default_sqlite_ddl_is_the_embedded_migration() {
        let migration =
            include_str!("../migrations/sqlite/2025-06-01-000000_create_idem_records/up.sql");
        assert_eq!(Table::default().sqlite_ddl(), migration);
    }

    #[test]
    fn check_columns_names_what_is_missing() {
        let table = Table::default();
        let rows = |names: &[&str]| -> Vec<ColumnRow> {
            names
                .iter()
                .map(|name| ColumnRow {
                    name: (*name).to_owned(),
                })
                .collect()
        };
        assert!(table.check_columns(&rows(COLUMNS)).is_ok());
        let error = table.check_columns(&[]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the idempotency table idem_records is missing: run store.migrate() at start-up \
             (or apply store.ddl() with your migration tool)"
        );
        let older: Vec<&str> = COLUMNS
            .iter()
            .copied()
            .filter(|c| !matches!(*c, "replayable" | "created_at"))
            .collect();
        let error = table.check_columns(&rows(&older)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the idempotency table idem_records is older than this library (it lacks the \
             column(s) replayable, created_at): run store.migrate() at start-up"
        );
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn every_column_is_in_the_postgres_ddl() {
        let ddl = Table::default().postgres_ddl();
        for column in COLUMNS {
            assert!(ddl.contains(&format!("\n    {column} ")), "{column}");
        }
    }

    #[cfg(feature = "sqlite")]
    #[test]
    fn every_column_is_in_the_sqlite_ddl() {
        let ddl = Table::default().sqlite_ddl();
        for column in COLUMNS {
            assert!(ddl.contains(&format!("\n    {column} ")), "{column}");
        }
    }

    #[test]
    fn names_are_quoted_and_qualified() {
        let table = Table::new(Some("billing"), "Keys_2").unwrap();
        assert_eq!(table.sql(), "\"billing\".\"Keys_2\"");
        assert_eq!(table.display(), "billing.Keys_2");
        assert!(!table.is_default());
        assert!(Table::new(None, DEFAULT_TABLE).unwrap().is_default());
        assert!(
            !Table::new(Some("public"), DEFAULT_TABLE)
                .unwrap()
                .is_default()
        );
    }

    #[test]
    fn names_that_would_need_escaping_are_refused() {
        for bad in ["", "1abc", "a-b", "a\"b", "a b", "tâble", &"t".repeat(53)] {
            let error = Table::new(None, bad).unwrap_err();
            assert!(
                matches!(error, SetupError::InvalidName { kind: "table", .. }),
                "{bad:?}"
            );
        }
        let error = Table::new(Some("x;drop"), "t").unwrap_err();
        assert!(matches!(
            error,
            SetupError::InvalidName { kind: "schema", .. }
        ));
        assert!(Table::new(None, &"t".repeat(52)).is_ok());
    }
}
