//! The journal's closed vocabularies: the state of an approval interrupt
//! ([`InterruptState`], column `interrupts.state`), the state a model round ended in
//! ([`RoundState`], column `rounds.state`), and `contentTrust` as the journal stores it
//! ([`ContentTrust`], columns `rounds.content_trust` and `responses.content_trust`). Each
//! is written and read by its one spelling (`as_str`), the same in SQL, JSON and logs.
//!
//! A stored value outside a vocabulary is refused when read ([`UnknownValue`]), never mapped
//! to a default: an interrupt whose stored state turnguard does not know is not pending, not
//! accepted, nothing (fail closed), and a trust value it does not know is not `trusted`.

use std::str::FromStr;

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSql, ToSqlOutput, ValueRef};

use crate::policy::bundle::ContentTrust;

/// A stored value outside its column's vocabulary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the journal's {column} holds `{value}`, which is not one of {expected}")]
pub struct UnknownValue {
    /// The column (`interrupts.state` …).
    pub column: &'static str,
    /// The stored value, cut to 64 characters (control characters as `?`).
    pub value: String,
    /// The vocabulary, comma-separated.
    pub expected: &'static str,
}

impl UnknownValue {
    fn new(column: &'static str, value: &str, expected: &'static str) -> Self {
        Self {
            column,
            value: value
                .chars()
                .take(64)
                .map(|c| if c.is_control() { '?' } else { c })
                .collect(),
            expected,
        }
    }
}

/// Implements `FromStr`, `Display`, `Serialize` and the SQLite conversions by the spelling.
macro_rules! spelled {
    ($t:ty, $column:literal, [$($v:ident),* $(,)?]) => {
        impl FromStr for $t {
            type Err = UnknownValue;
            fn from_str(s: &str) -> Result<Self, UnknownValue> {
                [$(<$t>::$v),*]
                    .into_iter()
                    .find(|v| v.as_str() == s)
                    .ok_or_else(|| UnknownValue::new($column, s, <$t>::EXPECTED))
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl ToSql for $t {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.as_str()))
            }
        }

        impl FromSql for $t {
            fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
                value
                    .as_str()?
                    .parse()
                    .map_err(|e: UnknownValue| FromSqlError::Other(Box::new(e)))
            }
        }
    };
}

/// The state of an approval interrupt (tool-turn contract §C; OpenWOP interrupt.md): it is
/// raised `pending` and leaves `pending` once, by compare-and-set in the journal writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InterruptState {
    /// Raised, not resolved.
    Pending,
    /// The bound person accepted it (`accept` or `edit-accept`).
    Accepted,
    /// The bound person rejected it, or the host did (nobody can approve).
    Rejected,
    /// It timed out (a timeout never approves).
    Expired,
}

impl InterruptState {
    const EXPECTED: &'static str = "pending, accepted, rejected, expired";

    /// The stable spelling (`interrupts.state`, the admin API's `state`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Accepted => "accepted",
            Self::Rejected => "rejected",
            Self::Expired => "expired",
        }
    }
}

spelled!(
    InterruptState,
    "interrupts.state",
    [Pending, Accepted, Rejected, Expired]
);

/// How a model round ended, as journaled (`rounds.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RoundState {
    /// The response was relayed (its calls decided).
    Ok,
    /// The provider answered with an error (status or error event).
    UpstreamError,
    /// The round failed: a stream cut or broken, an invalid response.
    Failed,
    /// The agent went away before the round was delivered.
    ClientGone,
    /// A withheld call or a rejected text answer surfaced as an error to the agent.
    SurfacedError,
    /// The model is asked again (a repair round follows).
    Repaired,
}

impl RoundState {
    const EXPECTED: &'static str =
        "ok, upstream_error, failed, client_gone, surfaced_error, repaired";

    /// The stable spelling (`rounds.state`, `turnguard journal show`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::UpstreamError => "upstream_error",
            Self::Failed => "failed",
            Self::ClientGone => "client_gone",
            Self::SurfacedError => "surfaced_error",
            Self::Repaired => "repaired",
        }
    }
}

spelled!(
    RoundState,
    "rounds.state",
    [
        Ok,
        UpstreamError,
        Failed,
        ClientGone,
        SurfacedError,
        Repaired
    ]
);

impl ContentTrust {
    const EXPECTED: &'static str = "trusted, untrusted";
}

impl FromStr for ContentTrust {
    type Err = UnknownValue;
    fn from_str(s: &str) -> Result<Self, UnknownValue> {
        [Self::Trusted, Self::Untrusted]
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| UnknownValue::new("content_trust", s, Self::EXPECTED))
    }
}

impl ToSql for ContentTrust {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.as_str()))
    }
}

impl FromSql for ContentTrust {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
        value
            .as_str()?
            .parse()
            .map_err(|e: UnknownValue| FromSqlError::Other(Box::new(e)))
    }
}

/// The [`UnknownValue`] a row decode failed on, if that is why it failed.
pub(super) fn unknown_value(e: &rusqlite::Error) -> Option<&UnknownValue> {
    match e {
        rusqlite::Error::FromSqlConversionFailure(_, _, source) => source.downcast_ref(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_unknown_values_are_refused() {
        for s in [
            InterruptState::Pending,
            InterruptState::Accepted,
            InterruptState::Rejected,
            InterruptState::Expired,
        ] {
            assert_eq!(s.as_str().parse::<InterruptState>(), Ok(s));
            assert_eq!(serde_json::json!(s), serde_json::json!(s.as_str()));
        }
        for s in [
            RoundState::Ok,
            RoundState::UpstreamError,
            RoundState::Failed,
            RoundState::ClientGone,
            RoundState::SurfacedError,
            RoundState::Repaired,
        ] {
            assert_eq!(s.as_str().parse::<RoundState>(), Ok(s));
        }
        for t in [ContentTrust::Trusted, ContentTrust::Untrusted] {
            assert_eq!(t.as_str().parse::<ContentTrust>(), Ok(t));
        }
        let e = "approved".parse::<InterruptState>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "the journal's interrupts.state holds `approved`, which is not one of pending, accepted, rejected, expired"
        );
        assert!("Accepted".parse::<InterruptState>().is_err());
        assert!("".parse::<InterruptState>().is_err());
        assert!("TRUSTED".parse::<ContentTrust>().is_err());
    }
}
