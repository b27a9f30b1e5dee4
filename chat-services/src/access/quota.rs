//! What one user may take of an instance, so one client cannot take everyone's share:
//! sends at a steady rate with bursts (a token bucket per user), and event streams open at
//! once. Counted per instance; behind a load balancer a user's share is that times the
//! instances they reach.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Buckets kept before full ones (keys idle long enough to have refilled) are dropped.
const SWEEP_ABOVE: usize = 10_000;

pub(crate) struct Quotas {
    /// Each user's sends (`--send-rate`, `--send-burst`).
    sends: Buckets<String>,
    max_streams: usize,
    streams: Mutex<HashMap<String, usize>>,
}

/// Token buckets, one per key: a key may take `burst` at once after being idle and `rate`
/// per second after that. Full buckets (keys idle long enough) are dropped once there are
/// many, so the map holds the keys that are active.
pub(crate) struct Buckets<K> {
    rate: f64,
    burst: f64,
    state: Mutex<BucketMap<K>>,
}

struct BucketMap<K> {
    buckets: HashMap<K, Bucket>,
    /// When full buckets were last dropped: at most once a second, so a map of many busy
    /// keys is not scanned on every take.
    swept: Option<Instant>,
}

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(self, now: Instant, rate: f64, burst: f64) -> f64 {
        (self.tokens + now.duration_since(self.at).as_secs_f64() * rate).min(burst)
    }
}

impl<K: Hash + Eq + Clone> Buckets<K> {
    pub(crate) fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate,
            burst,
            state: Mutex::new(BucketMap {
                buckets: HashMap::new(),
                swept: None,
            }),
        }
    }

    pub(crate) fn rate(&self) -> f64 {
        self.rate
    }

    pub(crate) fn burst(&self) -> f64 {
        self.burst
    }

    /// Take one from `key`'s bucket, or say how long until there is one.
    pub(crate) fn take(&self, key: &K) -> Result<(), Duration> {
        self.at(Instant::now(), key, true)
    }

    /// Whether `key` could take one now (nothing is taken), or how long until it could.
    pub(crate) fn check(&self, key: &K) -> Result<(), Duration> {
        self.at(Instant::now(), key, false)
    }

    /// Check or take at `now`.
    fn at(&self, now: Instant, key: &K, take: bool) -> Result<(), Duration> {
        let mut state = self.state.lock().expect("not poisoned");
        let due = state
            .swept
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1));
        if state.buckets.len() > SWEEP_ABOVE && due {
            let (rate, burst) = (self.rate, self.burst);
            state
                .buckets
                .retain(|_, b| b.refilled(now, rate, burst) < burst);
            state.swept = Some(now);
        }
        let tokens = state
            .buckets
            .get(key)
            .map_or(self.burst, |b| b.refilled(now, self.rate, self.burst));
        if tokens < 1.0 {
            return Err(Duration::from_secs_f64((1.0 - tokens) / self.rate));
        }
        if take {
            state.buckets.insert(
                key.clone(),
                Bucket {
                    tokens: tokens - 1.0,
                    at: now,
                },
            );
        }
        Ok(())
    }

    /// Give back one taken by [`Buckets::take`] that cost nothing.
    pub(crate) fn give_back(&self, key: &K) {
        let mut state = self.state.lock().expect("not poisoned");
        if let Some(bucket) = state.buckets.get_mut(key) {
            bucket.tokens = (bucket.tokens + 1.0).min(self.burst);
        }
    }

    /// Keys with a bucket now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.state.lock().expect("not poisoned").buckets.len()
    }
}

/// One of a user's open event streams; gives its place back when dropped.
pub(crate) struct StreamSlot {
    quotas: Arc<Quotas>,
    user: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut streams = self.quotas.streams.lock().expect("not poisoned");
        if let Some(n) = streams.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                streams.remove(&self.user);
            }
        }
    }
}

impl Quotas {
    pub(crate) fn new(rate: f64, burst: u32, max_streams: usize) -> Self {
        Self {
            sends: Buckets::new(rate, f64::from(burst)),
            max_streams,
            streams: Mutex::default(),
        }
    }

    pub(crate) fn rate(&self) -> f64 {
        self.sends.rate()
    }

    pub(crate) fn burst(&self) -> f64 {
        self.sends.burst()
    }

    pub(crate) fn max_streams(&self) -> usize {
        self.max_streams
    }

    /// Take one send from `user`'s bucket, or say how long until there is one.
    pub(crate) fn take_send(&self, user: &str) -> Result<(), Duration> {
        self.sends.take(&user.to_string())
    }

    /// Give back a send taken by [`Quotas::take_send`] that wrote nothing.
    pub(crate) fn give_back(&self, user: &str) {
        self.sends.give_back(&user.to_string())
    }

    /// A place for one more of `user`'s event streams, unless they hold the most already.
    pub(crate) fn open_stream(self: &Arc<Self>, user: &str) -> Option<StreamSlot> {
        let mut streams = self.streams.lock().expect("not poisoned");
        let n = streams.entry(user.to_string()).or_insert(0);
        if *n >= self.max_streams {
            return None;
        }
        *n += 1;
        Some(StreamSlot {
            quotas: self.clone(),
            user: user.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_steady_rate() {
        let quotas = Quotas::new(2.0, 3, 1);
        for _ in 0..3 {
            assert!(quotas.take_send("a").is_ok());
        }
        let wait = quotas.take_send("a").unwrap_err();
        assert!(
            wait <= Duration::from_millis(500) && wait > Duration::ZERO,
            "{wait:?}"
        );
        // Another user has a bucket of their own.
        assert!(quotas.take_send("b").is_ok());
        // A send given back (it wrote nothing) may be made again.
        quotas.give_back("a");
        assert!(quotas.take_send("a").is_ok());
    }

    #[test]
    fn checking_takes_nothing_and_idle_keys_are_dropped_when_many() {
        let buckets: Buckets<u32> = Buckets::new(1.0, 2.0);
        assert!(buckets.check(&1).is_ok());
        assert_eq!(buckets.len(), 0, "a check leaves no bucket");
        buckets.take(&1).unwrap();
        buckets.take(&1).unwrap();
        assert!(buckets.check(&1).is_err(), "empty until it refills");
        for key in 2..=(SWEEP_ABOVE as u32 + 2) {
            buckets.take(&key).unwrap();
        }
        // 5 s later all have refilled: the next take sweeps the full ones.
        let later = Instant::now() + Duration::from_secs(5);
        buckets.at(later, &u32::MAX, true).unwrap();
        assert_eq!(buckets.len(), 1, "only the key just taken stays");
    }

    #[test]
    fn stream_places_come_back_when_a_stream_ends() {
        let quotas = Arc::new(Quotas::new(1.0, 1, 2));
        let one = quotas.open_stream("a").unwrap();
        let _two = quotas.open_stream("a").unwrap();
        assert!(quotas.open_stream("a").is_none());
        assert!(quotas.open_stream("b").is_some());
        drop(one);
        assert!(quotas.open_stream("a").is_some());
    }
}
