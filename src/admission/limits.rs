//! Runtime state of the limits stage (tool-turn contract §B stage 6): a token bucket per
//! (principal, tool) and a released-call counter per run. In memory and per turnguard
//! process; both bounded, and neither ever resets anyone's budget to make room.
//!
//! - **Buckets**: `governor`'s keyed GCRA limiter, one per configured [`Rate`] (a reload that
//!   changes the rate starts fresh buckets). A key whose bucket is full again is
//!   indistinguishable from a new one; [`LimitState::sweep`] (on a timer, `server::start`)
//!   drops those keys (`retain_recent`) and gives the memory back (`shrink_to_fit`). Memory
//!   is thus bounded by the (principal, tool) pairs that spent tokens within one refill
//!   period, never reset wholesale.
//! - **Run counters**: an LRU of at most [`MAX_RUNS`] runs, least recently used evicted
//!   first (counted in `turnguard_run_counter_evictions_total`). A run that is not in the
//!   LRU is seeded from the journal's count of its released calls before its turn is
//!   admitted ([`LimitState::needs_seed`], [`LimitState::seed`]), so an eviction or a
//!   restart never hands a run a fresh budget.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use hashlink::LruCache;

use crate::policy::bundle::Rate;

/// Runs whose released-call count is kept in memory at most (each entry is a run id and a
/// counter: ~100 bytes). A run evicted is seeded from the journal again when it returns.
pub const MAX_RUNS: usize = 10_000;

/// Seconds reported until the next token when the bucket never refills (`per_minute = 0`).
const NEVER_REFILLS_SECS: u64 = 3600;

type Limiter = DefaultKeyedRateLimiter<(String, String)>;

/// Limits state shared by every request.
pub struct LimitState {
    /// One keyed limiter per rate, by (burst, per minute).
    buckets: Mutex<HashMap<(u32, u32), Arc<Limiter>>>,
    runs: Mutex<LruCache<String, u32>>,
    /// Run counters evicted so far (`turnguard_run_counter_evictions_total` reads the delta).
    evictions: prometheus_client::metrics::counter::Counter,
    clock: DefaultClock,
}

impl Default for LimitState {
    fn default() -> Self {
        Self::new(prometheus_client::metrics::counter::Counter::default())
    }
}

impl LimitState {
    /// Empty state; run-counter evictions are counted in `evictions`.
    pub fn new(evictions: prometheus_client::metrics::counter::Counter) -> Self {
        Self {
            buckets: Mutex::new(HashMap::new()),
            runs: Mutex::new(LruCache::new(MAX_RUNS)),
            evictions,
            clock: DefaultClock::default(),
        }
    }

    fn limiter(&self, rate: &Rate) -> Option<Arc<Limiter>> {
        let mut map = self.buckets.lock().ok()?;
        let key = (rate.burst.max(1), rate.per_minute);
        if let Some(l) = map.get(&key) {
            return Some(Arc::clone(l));
        }
        let burst = NonZeroU32::new(key.0)?;
        let quota = match NonZeroU32::new(rate.per_minute) {
            Some(per_minute) => Quota::per_minute(per_minute).allow_burst(burst),
            // Never refills: `burst` calls, then none (a period longer than any process lives).
            None => Quota::with_period(std::time::Duration::from_secs(u64::from(u32::MAX)))?
                .allow_burst(burst),
        };
        let l = Arc::new(RateLimiter::keyed(quota));
        map.insert(key, Arc::clone(&l));
        Some(l)
    }

    /// Takes one token for (principal, tool). `Err(seconds)` until the next token.
    pub fn take(&self, principal: &str, tool: &str, rate: &Rate) -> Result<(), u64> {
        let Some(limiter) = self.limiter(rate) else {
            return Err(1); // poisoned: fail closed
        };
        match limiter.check_key(&(principal.to_owned(), tool.to_owned())) {
            Ok(()) => Ok(()),
            Err(_) if rate.per_minute == 0 => Err(NEVER_REFILLS_SECS),
            Err(not_until) => {
                let wait = not_until.wait_time_from(self.clock.now());
                Err(wait.as_secs_f64().ceil().max(1.0) as u64)
            }
        }
    }

    /// Drops bucket keys whose bucket is full again (indistinguishable from a fresh one) and
    /// limiters left empty, and gives their memory back. Call on a timer.
    pub fn sweep(&self) {
        let Ok(mut map) = self.buckets.lock() else {
            return;
        };
        for l in map.values() {
            l.retain_recent();
            l.shrink_to_fit();
        }
        map.retain(|_, l| !l.is_empty());
    }

    /// Bucket keys held (for tests and the soak).
    pub fn bucket_keys(&self) -> usize {
        self.buckets
            .lock()
            .map(|m| m.values().map(|l| l.len()).sum())
            .unwrap_or(0)
    }

    /// Calls released so far in `run` (`u32::MAX` when the state is poisoned: fail closed).
    pub fn run_count(&self, run: &str) -> u32 {
        self.runs
            .lock()
            .map(|mut m| m.get(run).copied().unwrap_or(0))
            .unwrap_or(u32::MAX)
    }

    /// `run` has no counter in memory: seed it from the journal ([`Self::seed`]) before its
    /// turn is admitted.
    pub fn needs_seed(&self, run: &str) -> bool {
        self.runs
            .lock()
            .map(|m| !m.contains_key(run))
            .unwrap_or(false)
    }

    /// Sets `run`'s counter to `released` (the journal's count of its released calls) if it
    /// has none yet.
    pub fn seed(&self, run: &str, released: u32) {
        if let Ok(mut m) = self.runs.lock() {
            if !m.contains_key(run) {
                self.insert(&mut m, run, released);
            }
        }
    }

    /// Counts `n` more released calls in `run`.
    pub fn add_run(&self, run: &str, n: u32) {
        if let Ok(mut m) = self.runs.lock() {
            match m.get_mut(run) {
                Some(c) => *c = c.saturating_add(n),
                None => self.insert(&mut m, run, n),
            }
        }
    }

    fn insert(&self, m: &mut LruCache<String, u32>, run: &str, count: u32) {
        if m.len() >= m.capacity() {
            m.remove_lru();
            self.evictions.inc();
        }
        m.insert(run.to_owned(), count);
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

    /// A sweep keeps every bucket that is not full again: no one's budget is reset to make
    /// room (the old table cleared itself, refilling everyone, at 100k entries).
    #[test]
    fn a_sweep_keeps_spent_buckets_and_a_never_refilling_rate_stays_spent() {
        let s = LimitState::default();
        let never = Rate {
            burst: 1,
            per_minute: 0,
        };
        for i in 0..1000 {
            assert!(s.take(&format!("p{i}"), "t", &never).is_ok());
        }
        s.sweep();
        assert_eq!(s.bucket_keys(), 1000, "spent buckets are kept");
        assert_eq!(s.take("p7", "t", &never), Err(NEVER_REFILLS_SECS));
    }

    /// The run counters are an LRU: the least recently used run goes first, counted; a run
    /// that comes back is seeded (from the journal) instead of starting at 0.
    #[test]
    fn run_counters_evict_the_least_recently_used_and_reseed() {
        let evictions = prometheus_client::metrics::counter::Counter::default();
        let s = LimitState::new(evictions.clone());
        s.add_run("old", 3);
        for i in 0..MAX_RUNS {
            s.add_run(&format!("r{i}"), 1);
        }
        assert_eq!(evictions.get(), 1);
        assert!(s.needs_seed("old"));
        s.seed("old", 3);
        assert_eq!(s.run_count("old"), 3);
        s.seed("old", 0);
        assert_eq!(s.run_count("old"), 3, "a seed never lowers a live counter");
    }
}
