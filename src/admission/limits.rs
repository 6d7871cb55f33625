//! Runtime state of the limits stage (tool-turn contract §B stage 6): a token bucket per
//! (principal, tool) and a released-call counter per run. In memory, bounded; limits are
//! per turnguard process.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::policy::bundle::Rate;

/// Entries kept before a table is reset (bounds memory against unbounded principals/runs).
const MAX_ENTRIES: usize = 100_000;

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Limits state shared by every request.
#[derive(Default)]
pub struct LimitState {
    buckets: Mutex<HashMap<(String, String), Bucket>>,
    runs: Mutex<HashMap<String, u32>>,
}

impl LimitState {
    /// Takes one token for (principal, tool). `Err(seconds)` until the next token.
    pub fn take(&self, principal: &str, tool: &str, rate: &Rate) -> Result<(), u64> {
        let Ok(mut map) = self.buckets.lock() else {
            return Err(1); // poisoned: fail closed
        };
        if map.len() >= MAX_ENTRIES {
            map.clear();
        }
        let now = Instant::now();
        let burst = f64::from(rate.burst.max(1));
        let per_sec = f64::from(rate.per_minute) / 60.0;
        let b = map
            .entry((principal.to_owned(), tool.to_owned()))
            .or_insert(Bucket {
                tokens: burst,
                at: now,
            });
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * per_sec).min(burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else if per_sec <= 0.0 {
            Err(3600)
        } else {
            Err(((1.0 - b.tokens) / per_sec).ceil().max(1.0) as u64)
        }
    }

    /// Calls released so far in `run`.
    pub fn run_count(&self, run: &str) -> u32 {
        self.runs
            .lock()
            .map(|m| m.get(run).copied().unwrap_or(0))
            .unwrap_or(u32::MAX)
    }

    /// Counts `n` more released calls in `run`.
    pub fn add_run(&self, run: &str, n: u32) {
        if let Ok(mut m) = self.runs.lock() {
            if m.len() >= MAX_ENTRIES {
                m.clear();
            }
            *m.entry(run.to_owned()).or_default() += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_a_burst_then_refuses_with_retry_after() {
        let s = LimitState::default();
        let rate = Rate {
            burst: 2,
            per_minute: 6,
        };
        assert!(s.take("p", "t", &rate).is_ok());
        assert!(s.take("p", "t", &rate).is_ok());
        let wait = s.take("p", "t", &rate).unwrap_err();
        assert!((1..=10).contains(&wait), "{wait}");
        assert!(s.take("q", "t", &rate).is_ok(), "buckets are per principal");
    }
}
