//! The capped body reader. Nothing else in turnguard collects a body: every request body,
//! and every upstream body turnguard must parse, goes through [`read_capped`] (or
//! [`read_capped_within`], the same reader with deadlines).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use tokio::time::{Instant, Sleep};

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The body was longer than the cap (bytes). The caller's message names the cap's flag.
    #[error("body exceeds the {0}-byte limit")]
    TooLarge(usize),
    /// A deadline of [`read_capped_within`] passed.
    #[error(transparent)]
    TimedOut(TimedOut),
    /// The connection failed while the body was read.
    #[error("body could not be read: {0}")]
    Read(String),
}

/// Which deadline of [`read_capped_within`] passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TimedOut {
    /// No frame arrived for this long.
    #[error("no body data for {} ms", .0.as_millis())]
    Idle(Duration),
    /// The whole body did not arrive within this long.
    #[error("the body did not complete within {} ms", .0.as_millis())]
    Deadline(Duration),
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

/// [`read_capped`] with deadlines: at most `idle` between two frames (when given), and the
/// whole body within `within` from now. A slow or stalled peer cannot hold the caller longer
/// (issue 11: a client trickling its request body, an upstream that stalls after its headers).
///
/// Errors: those of [`read_capped`], and [`BodyError::TimedOut`] naming the deadline.
pub async fn read_capped_within<B>(
    body: B,
    limit: usize,
    idle: Option<Duration>,
    within: Duration,
) -> Result<Bytes, BodyError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let fired = Arc::new(OnceLock::new());
    let timed = Timed {
        inner: body,
        idle,
        idle_sleep: idle.map(|d| Box::pin(tokio::time::sleep(d))),
        deadline: Box::pin(tokio::time::sleep_until(Instant::now() + within)),
        within,
        fired: Arc::clone(&fired),
    };
    match read_capped(timed, limit).await {
        Err(BodyError::Read(_)) if fired.get().is_some() => Err(BodyError::TimedOut(
            fired.get().copied().unwrap_or(TimedOut::Deadline(within)),
        )),
        other => other,
    }
}

/// A body that fails with [`TimedOut`] when a deadline passes.
struct Timed<B> {
    inner: B,
    idle: Option<Duration>,
    idle_sleep: Option<Pin<Box<Sleep>>>,
    deadline: Pin<Box<Sleep>>,
    within: Duration,
    /// Which deadline passed, for [`read_capped_within`]'s error.
    fired: Arc<OnceLock<TimedOut>>,
}

/// The error of a [`Timed`] body: the inner body's, or a deadline.
#[derive(Debug, thiserror::Error)]
pub enum TimedError<E> {
    /// The inner body failed.
    #[error(transparent)]
    Inner(E),
    /// A deadline passed.
    #[error(transparent)]
    TimedOut(TimedOut),
}

impl<B> Body for Timed<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Data = Bytes;
    type Error = TimedError<B::Error>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(sleep), Some(d)) = (this.idle_sleep.as_mut(), this.idle) {
                    sleep.as_mut().reset(Instant::now() + d);
                }
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(TimedError::Inner(e)))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
        }
        let fire = |t: TimedOut| {
            let _ = this.fired.set(t);
            Poll::Ready(Some(Err(TimedError::TimedOut(t))))
        };
        if this.deadline.as_mut().poll(cx).is_ready() {
            return fire(TimedOut::Deadline(this.within));
        }
        if let (Some(sleep), Some(d)) = (this.idle_sleep.as_mut(), this.idle) {
            if sleep.as_mut().poll(cx).is_ready() {
                return fire(TimedOut::Idle(d));
            }
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Chunks = http_body_util::StreamBody<
        tokio_stream::wrappers::ReceiverStream<Result<Frame<Bytes>, std::io::Error>>,
    >;

    fn channel() -> (
        tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>,
        Chunks,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        (
            tx,
            http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
        )
    }

    #[tokio::test]
    async fn a_stalled_body_fails_at_the_idle_deadline_and_a_slow_one_at_the_whole() {
        let (tx, body) = channel();
        tx.send(Ok(Frame::data(Bytes::from_static(b"{"))))
            .await
            .unwrap();
        let err = read_capped_within(
            body,
            1024,
            Some(Duration::from_millis(100)),
            Duration::from_secs(10),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, BodyError::TimedOut(TimedOut::Idle(_))),
            "{err}"
        );

        let (tx, body) = channel();
        let feeder = tokio::spawn(async move {
            while tx
                .send(Ok(Frame::data(Bytes::from_static(b" "))))
                .await
                .is_ok()
            {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        });
        let err = read_capped_within(
            body,
            1 << 20,
            Some(Duration::from_millis(100)),
            Duration::from_millis(400),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, BodyError::TimedOut(TimedOut::Deadline(_))),
            "{err}"
        );
        feeder.abort();
    }
}
