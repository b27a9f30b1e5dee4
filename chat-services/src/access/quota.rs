//! What one user may take, so one client cannot take everyone's share: budgets of sends,
//! history reads, stream opens and sign-ins (token buckets shared by the side's instances,
//! see `budgets`), and on each instance the event streams they hold open and the requests
//! they have in flight at once (an answer counts until it is written: one never read holds
//! its memory). The token buckets themselves are here too, for every limit that counts
//! per key on one instance.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Buckets kept before full ones (keys idle long enough to have refilled) are dropped.
const SWEEP_ABOVE: usize = 10_000;

pub(crate) struct Quotas {
    /// Each user's budgets (`--send-rate`, `--history-rate`, ...).
    pub budgets: Arc<super::budgets::Budgets>,
    max_streams: usize,
    streams: Mutex<HashMap<String, usize>>,
    max_in_flight: usize,
    in_flight: Mutex<HashMap<String, usize>>,
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

/// One of a user's places (an open event stream, a request in flight); given back when
/// dropped.
pub(crate) struct Place {
    quotas: Arc<Quotas>,
    user: String,
    streams: bool,
}

/// An open event stream's place.
pub(crate) type StreamSlot = Place;

impl Drop for Place {
    fn drop(&mut self) {
        let map = if self.streams {
            &self.quotas.streams
        } else {
            &self.quotas.in_flight
        };
        let mut map = map.lock().expect("not poisoned");
        if let Some(n) = map.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.user);
            }
        }
    }
}

impl Quotas {
    pub(crate) fn new(
        budgets: Arc<super::budgets::Budgets>,
        max_streams: usize,
        max_in_flight: usize,
    ) -> Self {
        Self {
            budgets,
            max_streams,
            streams: Mutex::default(),
            max_in_flight,
            in_flight: Mutex::default(),
        }
    }

    pub(crate) fn max_streams(&self) -> usize {
        self.max_streams
    }

    pub(crate) fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// A place for one more of `user`'s event streams, unless they hold the most already.
    pub(crate) fn open_stream(self: &Arc<Self>, user: &str) -> Option<StreamSlot> {
        self.place(user, true)
    }

    /// A place for one more of `user`'s requests in flight, unless they have the most.
    pub(crate) fn start_request(self: &Arc<Self>, user: &str) -> Option<Place> {
        self.place(user, false)
    }

    fn place(self: &Arc<Self>, user: &str, streams: bool) -> Option<Place> {
        let (map, max) = if streams {
            (&self.streams, self.max_streams)
        } else {
            (&self.in_flight, self.max_in_flight)
        };
        let mut map = map.lock().expect("not poisoned");
        let n = map.entry(user.to_string()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Place {
            quotas: self.clone(),
            user: user.to_string(),
            streams,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_steady_rate() {
        let buckets: Buckets<&str> = Buckets::new(2.0, 3.0);
        for _ in 0..3 {
            assert!(buckets.take(&"a").is_ok());
        }
        let wait = buckets.take(&"a").unwrap_err();
        assert!(
            wait <= Duration::from_millis(500) && wait > Duration::ZERO,
            "{wait:?}"
        );
        // Another key has a bucket of its own.
        assert!(buckets.take(&"b").is_ok());
        // One given back (it cost nothing) may be taken again.
        buckets.give_back(&"a");
        assert!(buckets.take(&"a").is_ok());
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
    fn places_come_back_when_a_stream_or_request_ends() {
        let budgets = crate::access::budgets::Budgets::local(
            crate::side::Side::Consumers,
            [crate::access::budgets::Budget {
                rate: 1.0,
                burst: 1,
            }; 4],
        );
        let quotas = Arc::new(Quotas::new(Arc::new(budgets), 2, 1));
        let one = quotas.open_stream("a").unwrap();
        let _two = quotas.open_stream("a").unwrap();
        assert!(quotas.open_stream("a").is_none());
        assert!(quotas.open_stream("b").is_some());
        drop(one);
        assert!(quotas.open_stream("a").is_some());
        // Requests in flight are counted apart from streams.
        let request = quotas.start_request("a").unwrap();
        assert!(quotas.start_request("a").is_none());
        drop(request);
        assert!(quotas.start_request("a").is_some());
    }
}
