//! One message's trace across the four processes it passes: W3C trace context
//! (`traceparent`) in the HTTP request, the outbox row, the stream entry and the live
//! hint, and spans exported over OTLP/HTTP.
//!
//! Off unless an endpoint is configured: then no span is made anywhere, and a
//! `traceparent` that came in is still passed on unchanged (validated), so a trace started
//! upstream continues through the instances that do export. Spans go through the SDK's
//! batch processor, on its own thread: the hot path only fills a queue.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracerProvider, Tracer};

use crate::error::ConfigError;

/// A span of ours (the SDK's; ended when dropped, or by `end`).
pub type Span = opentelemetry_sdk::trace::Span;
pub use opentelemetry::trace::{Span as SpanExt, SpanContext, Status};

/// The name of the W3C trace context header, outbox column and stream entry field.
pub const TRACEPARENT: &str = "traceparent";

static TRACER: OnceLock<Tracer> = OnceLock::new();

/// Where spans go.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TraceArgs {
    /// OTLP/HTTP (protobuf) collector to export spans to, e.g. `http://127.0.0.1:4318`
    /// (spans go to `<endpoint>/v1/traces`; `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, when
    /// set, names the full URL instead). Unset: no spans are made; a `traceparent` that
    /// comes in is still passed on. `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
    /// `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS`,
    /// `_TIMEOUT` and `_COMPRESSION` (gzip) apply; `OTEL_SDK_DISABLED=true` turns it off.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

fn parse_endpoint(raw: &str) -> Result<String, String> {
    let raw = raw.trim();
    // Credentials in the URL would be logged (the endpoint is, at start) and sent in the
    // clear: refused, and not repeated in the refusal.
    // Anywhere after the scheme: userinfo may itself hold a '/' (http://u:p/w@host).
    if raw
        .split_once("://")
        .map_or(raw, |(_, rest)| rest)
        .contains('@')
    {
        return Err("the URL holds credentials (user:password@): they would be logged and sent over plain HTTP; remove them and let the collector beside the process authenticate onward".into());
    }
    if raw.starts_with("https://") {
        return Err(format!(
            "'{raw}': OTLP over TLS is not built in; export to a collector beside the process (http://, loopback or the pod network) and let it forward over TLS"
        ));
    }
    let Some(rest) = raw.strip_prefix("http://") else {
        return Err(format!(
            "'{raw}' is not an http:// URL (e.g. http://127.0.0.1:4318)"
        ));
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(format!("'{raw}' names no host"));
    }
    Ok(raw.trim_end_matches('/').to_string())
}

/// Flushes the spans still queued when dropped (at the end of `main`).
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown_with_timeout(Duration::from_secs(5)) {
            tracing::warn!(error = %e, "spans still queued at exit may not have reached the collector");
        }
    }
}

/// Start exporting spans as `service_name` (unless `OTEL_SERVICE_NAME` says otherwise),
/// when an endpoint is configured. Refuses settings it cannot honour.
pub fn init(args: &TraceArgs, service_name: &str) -> Result<Option<Telemetry>, ConfigError> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let signal_endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    if args.otlp_endpoint.is_none() && signal_endpoint.is_none() {
        return Ok(None);
    }
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    for var in [
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    ] {
        if let Some(protocol) = env(var) {
            if protocol != "http/protobuf" {
                return Err(ConfigError::new(format!(
                    "{var}={protocol}: only http/protobuf is built in; unset it or set http/protobuf"
                )));
            }
        }
    }
    // Checked here, after OTEL_SDK_DISABLED: an endpoint this build cannot use, set by the
    // platform for every container, can be switched off without editing it.
    let endpoint = args
        .otlp_endpoint
        .as_deref()
        .map(parse_endpoint)
        .transpose()
        .map_err(|e| {
            ConfigError::new(format!(
                "--otlp-endpoint (OTEL_EXPORTER_OTLP_ENDPOINT): {e}; or set OTEL_SDK_DISABLED=true"
            ))
        })?;
    if let Some(url) = &signal_endpoint {
        parse_endpoint(url).map_err(|e| {
            ConfigError::new(format!(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: {e}; or set OTEL_SDK_DISABLED=true"
            ))
        })?;
    }
    use opentelemetry_otlp::WithExportConfig;
    // The exporter falls back to its default on a value it cannot read; say so instead.
    for var in [
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    ] {
        if let Some(value) = env(var) {
            if value.trim().parse::<u64>().is_err() {
                return Err(ConfigError::new(format!(
                    "{var}={value}: must be whole milliseconds, e.g. 5000"
                )));
            }
        }
    }
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_http();
    if env("OTEL_EXPORTER_OTLP_TIMEOUT").is_none()
        && env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT").is_none()
    {
        // Shorter than the SDK's 10 s: an export that hangs holds the queue that long.
        exporter = exporter.with_timeout(Duration::from_secs(5));
    }
    // The signal's own URL, when given, is taken whole by the exporter; the generic
    // endpoint gets the signal's path, as the specification says.
    if signal_endpoint.is_none() {
        if let Some(endpoint) = &endpoint {
            exporter = exporter.with_endpoint(format!("{endpoint}/v1/traces"));
        }
    }
    let exporter = exporter
        .build()
        .map_err(|e| ConfigError::new(format!("OTLP exporter: {e}")))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if env("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service_name.to_string());
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "outbox");
    if TRACER.set(tracer).is_err() {
        return Err(ConfigError::new("tracing was set up twice in one process"));
    }
    tracing::info!(
        endpoint = signal_endpoint.as_deref().or(endpoint.as_deref()),
        "exporting spans over OTLP"
    );
    Ok(Some(Telemetry { provider }))
}

/// Whether spans are made in this process.
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// The span context a `traceparent` names, or `None` for anything else: a bad value is
/// dropped, never passed on. The form is checked strictly here (lowercase hex, fixed
/// lengths; a later version may add fields after a `-`, as the W3C specification says),
/// what the ids mean by the SDK's propagator (all-zero ids, version ff).
pub fn parse(traceparent: &str) -> Option<SpanContext> {
    const LEN: usize = 55;
    let bytes = traceparent.as_bytes();
    let well_formed = bytes.len() >= LEN
        && bytes[..LEN].iter().enumerate().all(|(i, b)| match i {
            2 | 35 | 52 => *b == b'-',
            _ => matches!(b, b'0'..=b'9' | b'a'..=b'f'),
        })
        && match &bytes[..2] {
            b"00" => bytes.len() == LEN,
            _ => bytes.len() == LEN || (bytes[LEN] == b'-' && bytes.len() <= 512),
        };
    if !well_formed {
        return None;
    }
    struct One<'a>(&'a str);
    impl opentelemetry::propagation::Extractor for One<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            (key == TRACEPARENT).then_some(self.0)
        }
        fn keys(&self) -> Vec<&str> {
            vec![TRACEPARENT]
        }
    }
    use opentelemetry::propagation::TextMapPropagator as _;
    let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .extract(&One(&traceparent[..LEN]));
    let context = cx.span().span_context().clone();
    context.is_valid().then_some(context)
}

/// The `traceparent` of a span context.
pub fn format(context: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8()
    )
}

/// Start a span of `kind` under `parent` (a new trace without one), from `start` (now
/// when `None`). `None` when spans are off.
pub fn start(
    name: impl Into<std::borrow::Cow<'static, str>>,
    kind: SpanKind,
    parent: Option<&SpanContext>,
    start: Option<SystemTime>,
    attributes: Vec<KeyValue>,
) -> Option<Span> {
    start_linked(name, kind, parent, start, attributes, None)
}

/// [`start`], with a link to a context that is related but not trusted as the parent
/// (a client's, when a service does not continue it).
pub fn start_linked(
    name: impl Into<std::borrow::Cow<'static, str>>,
    kind: SpanKind,
    parent: Option<&SpanContext>,
    start: Option<SystemTime>,
    attributes: Vec<KeyValue>,
    link: Option<&SpanContext>,
) -> Option<Span> {
    let tracer = TRACER.get()?;
    let cx = match parent {
        Some(parent) => Context::new().with_remote_span_context(parent.clone()),
        None => Context::new(),
    };
    let mut builder = tracer
        .span_builder(name)
        .with_kind(kind)
        .with_attributes(attributes);
    if let Some(start) = start {
        builder = builder.with_start_time(start);
    }
    if let Some(link) = link {
        builder = builder.with_links(vec![opentelemetry::trace::Link::with_context(link.clone())]);
    }
    Some(builder.start_with_context(tracer, &cx))
}

/// The context a hop carries on: its own span's when it made one, else what it was given.
fn carried(span: Option<&Span>, given: Option<&SpanContext>) -> Option<SpanContext> {
    use opentelemetry::trace::Span as _;
    span.map(|s| s.span_context().clone())
        .filter(SpanContext::is_valid)
        .or_else(|| given.cloned())
        .filter(SpanContext::is_valid)
}

/// What a hop passes on, as a `traceparent` (see `carried`).
pub fn passed_on(span: Option<&Span>, given: Option<&SpanContext>) -> Option<String> {
    carried(span, given).as_ref().map(format)
}

/// The trace id to put in log lines of one message (empty without a trace).
pub fn trace_id(span: Option<&Span>, given: Option<&SpanContext>) -> String {
    carried(span, given)
        .map(|c| c.trace_id().to_string())
        .unwrap_or_default()
}

pub use opentelemetry::trace::SpanKind as Kind;
pub use opentelemetry::KeyValue as Attribute;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_round_trip_and_bad_ones_are_dropped() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = parse(tp).unwrap();
        assert!(context.is_sampled() && context.is_remote());
        assert_eq!(format(&context), tp);
        // A later version is read as 00 (its extra fields ignored); unknown flags dropped.
        let future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-extra";
        assert_eq!(format(&parse(future).unwrap()), tp);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            "00-1-2-1",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn endpoints_must_be_plain_http_with_a_host() {
        assert_eq!(
            parse_endpoint("http://127.0.0.1:4318/").unwrap(),
            "http://127.0.0.1:4318"
        );
        assert!(parse_endpoint("https://collector:4318")
            .unwrap_err()
            .contains("TLS"));
        for with_secret in [
            "http://user:s3cret@collector:4318",
            "http://u:s3cret/x@collector:4318",
        ] {
            let refused = parse_endpoint(with_secret).unwrap_err();
            assert!(
                refused.contains("credentials") && !refused.contains("s3cret"),
                "{refused}"
            );
        }
        assert!(parse_endpoint("collector:4318").is_err());
        assert!(parse_endpoint("http://").is_err());
    }

    #[test]
    fn without_an_endpoint_nothing_is_made_and_context_is_passed_on() {
        assert!(!enabled());
        assert!(start("x", Kind::Internal, None, None, vec![]).is_none());
        let given = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        assert_eq!(
            passed_on(None, given.as_ref()).as_deref(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        assert_eq!(
            trace_id(None, given.as_ref()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }
}
