//! What one user may take of an instance, so one client cannot take everyone's share:
//! sends at a steady rate with bursts (a token bucket per user), and event streams open at
//! once. Counted per instance; behind a load balancer a user's share is that times the
//! instances they reach.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Buckets kept before full ones (users idle long enough to have refilled) are dropped.
const SWEEP_ABOVE: usize = 10_000;

pub(crate) struct Quotas {
    /// Sends per second a user may keep up (`--send-rate`).
    rate: f64,
    /// Sends a user may make at once after being idle (`--send-burst`).
    burst: f64,
    max_streams: usize,
    sends: Mutex<Sends>,
    streams: Mutex<HashMap<String, usize>>,
}

#[derive(Default)]
struct Sends {
    buckets: HashMap<String, Bucket>,
    /// When full buckets were last dropped: at most once a second, so a map of many busy
    /// users is not scanned on every send.
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
            rate,
            burst: f64::from(burst),
            max_streams,
            sends: Mutex::default(),
            streams: Mutex::default(),
        }
    }

    pub(crate) fn rate(&self) -> f64 {
        self.rate
    }

    pub(crate) fn burst(&self) -> f64 {
        self.burst
    }

    pub(crate) fn max_streams(&self) -> usize {
        self.max_streams
    }

    /// Take one send from `user`'s bucket, or say how long until there is one.
    pub(crate) fn take_send(&self, user: &str) -> Result<(), Duration> {
        let now = Instant::now();
        let mut sends = self.sends.lock().expect("not poisoned");
        let due = sends
            .swept
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1));
        if sends.buckets.len() > SWEEP_ABOVE && due {
            let (rate, burst) = (self.rate, self.burst);
            sends
                .buckets
                .retain(|_, b| b.refilled(now, rate, burst) < burst);
            sends.swept = Some(now);
        }
        let bucket = sends.buckets.entry(user.to_string()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let tokens = bucket.refilled(now, self.rate, self.burst);
        if tokens >= 1.0 {
            *bucket = Bucket {
                tokens: tokens - 1.0,
                at: now,
            };
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - tokens) / self.rate))
        }
    }

    /// Give back a send taken by [`Quotas::take_send`] that wrote nothing.
    pub(crate) fn give_back(&self, user: &str) {
        let mut sends = self.sends.lock().expect("not poisoned");
        if let Some(bucket) = sends.buckets.get_mut(user) {
            bucket.tokens = (bucket.tokens + 1.0).min(self.burst);
        }
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
