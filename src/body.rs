//! The capped body reader. Nothing else in turnguard collects a body: every request body,
//! and every upstream body turnguard must parse, goes through [`read_capped`].

use bytes::Bytes;
use http_body::Body;
use http_body_util::{BodyExt, Limited};

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The body was longer than the cap (bytes).
    #[error("body exceeds the {0}-byte limit")]
    TooLarge(usize),
    /// The connection failed while the body was read.
    #[error("body could not be read: {0}")]
    Read(String),
}

/// Collects `body` into one buffer of at most `limit` bytes.
///
/// Errors: [`BodyError::TooLarge`] as soon as the limit is passed (the rest is not read),
/// [`BodyError::Read`] when the transport fails.
#[allow(clippy::disallowed_methods)] // this is the capped reader the lint points to
pub async fn read_capped<B>(body: B, limit: usize) -> Result<Bytes, BodyError>
where
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(BodyError::TooLarge(limit))
            } else {
                Err(BodyError::Read(e.to_string()))
            }
        }
    }
}
