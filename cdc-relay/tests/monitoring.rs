//! The monitoring files: the alert rules pass promtool and their unit tests, and every metric
//! the rules and the dashboard use is one the relay or the services define, and every alert's
//! runbook link points at a section of docs/operations.md.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn promtool(args: &[&str]) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(root().join("deploy/monitoring"))
        .output()
        .expect("promtool installed (deploy/install-deps.sh)");
    assert!(
        out.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    promtool(&["check", "rules", "alerts.yml"]);
    promtool(&["test", "rules", "alerts_test.yml"]);
    promtool(&["check", "config", "prometheus.yml"]);
}

/// Metric names in `text` (identifiers starting with one of our prefixes).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    for prefix in ["cdc_relay_", "chat_"] {
        let mut from = 0;
        while let Some(at) = text[from..].find(prefix) {
            let start = from + at;
            let boundary = start == 0
                || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
            let end = text[start..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(text.len(), |n| start + n);
            if boundary {
                names.insert(text[start..end].to_string());
            }
            from = end;
        }
    }
    names
}

/// outbox-consumer's metrics as the chat services register them: each name its
/// `counter(`, `gauge(` or `name(` calls give, under the services' `chat_` prefix.
fn consumer_metric_names() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("outbox-consumer/src/metrics.rs")).unwrap();
    let mut names = BTreeSet::new();
    for call in ["counter(", "gauge(", "name("] {
        for (at, _) in text.match_indices(call) {
            let rest = text[at + call.len()..].trim_start();
            if let Some(literal) = rest.strip_prefix('"') {
                let name = &literal[..literal.find('"').unwrap()];
                if !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
                    names.insert(format!("chat_{name}"));
                }
            }
        }
    }
    names
}

#[test]
fn rules_and_dashboard_use_only_metrics_that_exist() {
    let mut defined: BTreeSet<String> =
        ["cdc-relay/src/metrics.rs", "chat-services/src/metrics.rs"]
            .iter()
            .flat_map(|f| metric_names(&std::fs::read_to_string(root().join(f)).unwrap()))
            .collect();
    let consumer = consumer_metric_names();
    assert!(
        consumer.contains("chat_dead_lettered_total")
            && consumer.contains("chat_inbox_write_retries_total"),
        "{consumer:?}"
    );
    defined.extend(consumer);
    assert!(
        defined.contains("cdc_relay_slot_lag_bytes") && defined.contains("chat_delivery_seconds")
    );
    for file in [
        "deploy/monitoring/alerts.yml",
        "deploy/monitoring/dashboard.json",
    ] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        for used in metric_names(&text) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| used.strip_suffix(s))
                .filter(|b| defined.contains(*b))
                .unwrap_or(&used);
            assert!(
                defined.contains(base),
                "{file} uses {used}, which no metrics module defines"
            );
        }
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/monitoring/dashboard.json")).unwrap(),
    )
    .unwrap();
    assert!(dashboard["panels"].as_array().unwrap().len() > 10);
}

#[test]
fn every_alert_has_a_runbook_section() {
    let rules = std::fs::read_to_string(root().join("deploy/monitoring/alerts.yml")).unwrap();
    let docs = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert_eq!(alerts.len(), 25);
    for alert in alerts {
        assert!(
            docs.contains(&format!("### {alert}\n")),
            "docs/operations.md has no section for {alert}"
        );
        // A link a pager can open: the published docs' base (Prometheus' external label
        // runbook_base_url) and the section's anchor.
        assert!(
            rules.contains(&format!(
                "runbook_url: \"{{{{ with $externalLabels.runbook_base_url }}}}{{{{ . }}}}{{{{ else }}}}docs/operations.md{{{{ end }}}}#{}\"",
                alert.to_lowercase()
            )),
            "{alert} links no runbook"
        );
        // Every section gives the commands to run.
        let section = docs.split(&format!("### {alert}\n")).nth(1).unwrap();
        let section = section
            .split("\n### ")
            .next()
            .unwrap()
            .split("\n## ")
            .next()
            .unwrap();
        assert!(
            section.contains("\n```\n"),
            "docs/operations.md's {alert} gives no command to run"
        );
    }
    let prometheus =
        std::fs::read_to_string(root().join("deploy/monitoring/prometheus.yml")).unwrap();
    assert!(prometheus.contains("runbook_base_url: https://"));
}
