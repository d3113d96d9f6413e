//! A record as both backends read it back, and its decoding into core types.
//!
//! Both backends select the same columns under the same names: times as
//! microseconds since the Unix epoch, the owner as its 16 bytes. So one row type
//! and one decoder serve PostgreSQL and SQLite.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Binary, Bool, Integer, Nullable, Text};
use idem_core::store::{ClaimOutcome, OwnerToken, Record, RecordState};
use idem_core::{Fingerprint, IdempotencyKey, Scope, StoreError, StoredResponse};
use uuid::Uuid;

/// The `state` column of an in-progress record.
pub(crate) const IN_PROGRESS: &str = "in_progress";

/// The `state` column of a completed record.
pub(crate) const COMPLETED: &str = "completed";

/// Whether the record `r` may be claimed anew at `now` (each database's
/// current time): completed and past its retention, or in progress and past
/// its lease. An in-progress record past its retention but under a live
/// lease is still being worked on.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn claimable(now: &str) -> String {
    format!(
        "(r.state = '{COMPLETED}' AND r.expires_at <= {now}) \
         OR (r.state = '{IN_PROGRESS}' AND r.lease_until <= {now})"
    )
}

/// Whether the record `r` is gone at `now`: past its retention, and not
/// under a live lease. What `load` does not see and cleanup deletes.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn expired(now: &str) -> String {
    format!("r.expires_at <= {now} AND (r.state = '{COMPLETED}' OR r.lease_until <= {now})")
}

/// How a claim's insert takes over the record it met (when the record is
/// claimable): the claim's fingerprint, owner, lease and times, no response.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) const RECLAIM: &str = "ON CONFLICT (scope, key) DO UPDATE SET
                    fingerprint = excluded.fingerprint,
                    state = excluded.state,
                    owner = excluded.owner,
                    lease_until = excluded.lease_until,
                    status = NULL, headers = NULL, body = NULL, replayable = NULL,
                    expires_at = excluded.expires_at,
                    created_at = excluded.created_at";

/// The longest duration handed to a database: 100 years. Longer ones are
/// clamped, so that `now + duration` stays within every backend's time range.
const MAX_DURATION_MICROS: u128 = 100 * 366 * 24 * 60 * 60 * 1_000_000;

/// A stored record, as `load` and the found branch of `claim` select it.
#[derive(Debug, QueryableByName)]
pub(crate) struct RecordRow {
    #[diesel(sql_type = Binary)]
    fingerprint: Vec<u8>,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<Binary>)]
    owner: Option<Vec<u8>>,
    /// Microseconds since the Unix epoch.
    #[diesel(sql_type = Nullable<BigInt>)]
    lease_until: Option<i64>,
    #[diesel(sql_type = Nullable<Integer>)]
    status: Option<i32>,
    #[diesel(sql_type = Nullable<Binary>)]
    headers: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<Binary>)]
    body: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<Bool>)]
    replayable: Option<bool>,
    /// Microseconds since the Unix epoch.
    #[diesel(sql_type = BigInt)]
    expires_at: i64,
}

#[cfg(feature = "postgres")]
/// What a claim statement answers: whether it claimed, and the record it wrote
/// or found.
#[derive(Debug, QueryableByName)]
pub(crate) struct ClaimRow {
    #[diesel(sql_type = Bool)]
    pub(crate) claimed: bool,
    #[diesel(embed)]
    pub(crate) record: RecordRow,
}

#[cfg(feature = "postgres")]
impl ClaimRow {
    /// What `request`'s claim answers for what its statement returned, or
    /// `None` when the statement met a concurrent change and runs again.
    pub(crate) fn settled(
        row: Option<Self>,
        request: &idem_core::store::ClaimRequest,
    ) -> Option<Result<ClaimOutcome, StoreError>> {
        match row {
            Some(row) if row.claimed => Some(Ok(ClaimOutcome::Claimed(request.to_claim()))),
            Some(row) => Some(row.record.into_found()),
            None => None,
        }
    }
}

/// Whether a record is in progress under a live lease (`changed` polls it).
#[derive(Debug, QueryableByName)]
pub(crate) struct InProgressRow {
    #[diesel(sql_type = Bool)]
    pub(crate) in_progress: bool,
}

impl RecordRow {
    /// The record of `(scope, key)` this row holds.
    pub(crate) fn into_record(
        self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Record, StoreError> {
        let expires_at = time_from_micros(self.expires_at)?;
        let (fingerprint, state) = self.into_state()?;
        Ok(Record {
            scope: scope.clone(),
            key: key.clone(),
            fingerprint,
            state,
            expires_at,
        })
    }

    /// What a claim that did not win found: this (live) record.
    pub(crate) fn into_found(self) -> Result<ClaimOutcome, StoreError> {
        let (fingerprint, state) = self.into_state()?;
        Ok(match state {
            RecordState::InProgress { lease_until, .. } => ClaimOutcome::InProgress {
                fingerprint,
                lease_until,
            },
            RecordState::Completed { response } => ClaimOutcome::Completed {
                fingerprint,
                response,
            },
        })
    }

    fn into_state(self) -> Result<(Fingerprint, RecordState), StoreError> {
        let fingerprint = Fingerprint::from_slice(&self.fingerprint).ok_or_else(|| {
            corrupt(format!(
                "fingerprint is {} bytes, not 32",
                self.fingerprint.len()
            ))
        })?;
        let state = match self.state.as_str() {
            IN_PROGRESS => {
                let owner = self
                    .owner
                    .as_deref()
                    .and_then(|bytes| Uuid::from_slice(bytes).ok())
                    .ok_or_else(|| corrupt("in-progress record without a valid owner"))?;
                let lease_until = self
                    .lease_until
                    .ok_or_else(|| corrupt("in-progress record without a lease"))?;
                RecordState::InProgress {
                    owner: OwnerToken::from_uuid(owner),
                    lease_until: time_from_micros(lease_until)?,
                }
            }
            COMPLETED => RecordState::Completed {
                response: self.into_response()?,
            },
            other => return Err(corrupt(format!("unknown state {other:?}"))),
        };
        Ok((fingerprint, state))
    }

    fn into_response(self) -> Result<StoredResponse, StoreError> {
        let (Some(status), Some(headers), Some(body), Some(replayable)) =
            (self.status, self.headers, self.body, self.replayable)
        else {
            return Err(corrupt("completed record without its response"));
        };
        let status = u16::try_from(status)
            .map_err(|_| corrupt(format!("status {status} is out of range")))?;
        let headers = StoredResponse::decode_headers(&headers)
            .ok_or_else(|| corrupt("the stored headers are not a header encoding"))?;
        Ok(StoredResponse {
            status,
            headers,
            body: Bytes::from(body),
            replayable,
        })
    }
}

/// A duration as the microseconds bound into statements.
pub(crate) fn duration_micros(duration: Duration) -> i64 {
    let micros = duration.as_micros().min(MAX_DURATION_MICROS);
    i64::try_from(micros).unwrap_or(i64::MAX)
}

/// The instant `micros` microseconds after the Unix epoch.
pub(crate) fn time_from_micros(micros: i64) -> Result<SystemTime, StoreError> {
    let offset = Duration::from_micros(micros.unsigned_abs());
    let time = if micros >= 0 {
        UNIX_EPOCH.checked_add(offset)
    } else {
        UNIX_EPOCH.checked_sub(offset)
    };
    time.ok_or_else(|| corrupt(format!("time {micros} µs is out of range")))
}

/// The outcome of an owner-fenced statement: no row touched means the claim is
/// stale (another owner holds the record, or nobody does); an error is the
/// database's.
pub(crate) fn fenced(rows: diesel::QueryResult<usize>) -> Result<(), StoreError> {
    match rows {
        Ok(0) => Err(StoreError::StaleOwner),
        Ok(_) => Ok(()),
        Err(error) => Err(StoreError::unavailable(error)),
    }
}

fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn micros_become_times_on_both_sides_of_the_epoch() {
        for (micros, time) in [
            (0, UNIX_EPOCH),
            (
                1_717_171_717_123_456,
                UNIX_EPOCH + Duration::from_micros(1_717_171_717_123_456),
            ),
            (-42, UNIX_EPOCH - Duration::from_micros(42)),
        ] {
            assert_eq!(time_from_micros(micros).unwrap(), time);
        }
    }

    #[test]
    fn durations_are_clamped_to_a_century() {
        assert_eq!(duration_micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(
            duration_micros(Duration::MAX),
            i64::try_from(MAX_DURATION_MICROS).unwrap()
        );
    }

    fn completed_row() -> RecordRow {
        let response =
            StoredResponse::new(201, vec![idem_core::Header::new("set-cookie", "a=1")], "{}");
        RecordRow {
            fingerprint: vec![7; 32],
            state: COMPLETED.to_owned(),
            owner: None,
            lease_until: None,
            status: Some(201),
            headers: Some(response.encode_headers()),
            body: Some(b"{}".to_vec()),
            replayable: Some(true),
            expires_at: 1_000,
        }
    }

    #[test]
    fn a_completed_row_decodes_to_its_response() {
        let found = completed_row().into_found().unwrap();
        let ClaimOutcome::Completed {
            fingerprint,
            response,
        } = found
        else {
            panic!("expected a completed outcome, got {found:?}");
        };
        assert_eq!(fingerprint, Fingerprint::from_bytes([7; 32]));
        assert_eq!(response.status, 201);
        assert_eq!(response.header_values("set-cookie").count(), 1);
        assert_eq!(response.body, Bytes::from_static(b"{}"));
    }

    #[test]
    fn damaged_rows_are_corrupt_not_panics() {
        let damaged = [
            RecordRow {
                fingerprint: vec![1; 31],
                ..completed_row()
            },
            RecordRow {
                headers: Some(vec![0, 0, 0, 9]),
                ..completed_row()
            },
            RecordRow {
                status: Some(70_000),
                ..completed_row()
            },
            RecordRow {
                body: None,
                ..completed_row()
            },
            RecordRow {
                state: "paused".to_owned(),
                ..completed_row()
            },
            RecordRow {
                state: IN_PROGRESS.to_owned(),
                owner: Some(vec![1; 3]),
                lease_until: Some(5),
                ..completed_row()
            },
        ];
        for row in damaged {
            let debug = format!("{row:?}");
            assert!(
                matches!(row.into_found(), Err(StoreError::Corrupt(_))),
                "{debug}"
            );
        }
    }
}
