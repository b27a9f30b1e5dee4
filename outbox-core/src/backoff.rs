//! Exponential backoff with jitter, so a fleet of relays does not retry in lockstep.

use std::time::Duration;

use rand::Rng;

#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            current: initial,
        }
    }

    /// Reaching a server again: from `first` up to one second, so a server that comes back
    /// after a long outage is noticed within a second of it (an attempt costs one
    /// connection), not after a pause that grew through the outage.
    pub fn reconnecting(first: Duration) -> Self {
        Self::new(first, Duration::from_secs(1))
    }

    /// The next pause: uniformly in [d/2, d] for the current step d, then double d.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.current;
        self.current = (self.current * 2).min(self.max);
        jitter(d)
    }

    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

/// A duration uniformly in [d/2, d].
pub fn jitter(d: Duration) -> Duration {
    let half = d / 2;
    half + d.mul_f64(rand::rng().random_range(0.0..0.5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let delays: Vec<_> = (0..5).map(|_| b.next_delay()).collect();
        for (d, step) in delays.iter().zip([100u64, 200, 400, 400, 400]) {
            assert!(
                *d >= Duration::from_millis(step / 2) && *d <= Duration::from_millis(step),
                "{d:?} for step {step}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
