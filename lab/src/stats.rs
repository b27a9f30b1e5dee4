//! The figures a run reports, from its samples or from a component's histograms: pure
//! arithmetic, no I/O.

use serde::Serialize;

/// Latency samples of one variant, as quantiles in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub variant: String,
    pub samples: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

pub fn summarize(variant: &str, mut samples_ms: Vec<f64>) -> Summary {
    samples_ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let i = ((samples_ms.len() as f64 * q).ceil() as usize).clamp(1, samples_ms.len()) - 1;
        samples_ms[i]
    };
    Summary {
        variant: variant.to_string(),
        samples: samples_ms.len(),
        p50_ms: at(0.50),
        p95_ms: at(0.95),
        p99_ms: at(0.99),
        max_ms: *samples_ms.last().unwrap_or(&0.0),
    }
}

/// The `q` quantile of histogram `name` in a Prometheus text exposition, interpolated
/// linearly inside its bucket (NaN without observations).
pub fn histogram_quantile(text: &str, name: &str, q: f64) -> f64 {
    let bucket = format!("{name}_bucket");
    let mut buckets: Vec<(f64, f64)> = testkit::http::metric_samples(text)
        .into_iter()
        .filter(|(k, _)| k.split('{').next() == Some(bucket.as_str()))
        .filter_map(|(k, v)| {
            let le = k.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, v))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(_, total)) = buckets.last() else {
        return f64::NAN;
    };
    if total == 0.0 {
        return f64::NAN;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, count) in &buckets {
        if count >= rank {
            if le.is_infinite() {
                return lower;
            }
            return lower + (le - lower) * (rank - below) / (count - below).max(f64::MIN_POSITIVE);
        }
        (lower, below) = (le, count);
    }
    lower
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_their_bucket() {
        let text = "\
# TYPE h histogram
h_bucket{le=\"0.001\"} 50
h_bucket{le=\"0.002\"} 90
h_bucket{le=\"0.01\"} 100
h_bucket{le=\"+Inf\"} 100
h_sum 0.1
h_count 100
";
        assert!((histogram_quantile(text, "h", 0.5) - 0.001).abs() < 1e-12);
        assert!((histogram_quantile(text, "h", 0.7) - 0.0015).abs() < 1e-12);
        assert!((histogram_quantile(text, "h", 0.99) - 0.0092).abs() < 1e-12);
        assert!(histogram_quantile("", "h", 0.5).is_nan());
    }
}
