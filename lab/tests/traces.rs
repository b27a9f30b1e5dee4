//! One message's trace across the four processes it passes (issue 26): a POST on Consumers
//! with a `traceparent` yields the sending service's server span under that parent, the
//! relay's publish span under it, and Workers' inbox write and live push under those, all
//! in the request's trace, exported over OTLP to a receiver on loopback; a POST without one
//! starts a trace that goes the same way.

use std::time::Duration;

use crate::bins;
use lab::system::{Kind, Side, System};
use testkit::http::{Connection, SseClient};
use testkit::otlp::{OtlpReceiver, ReceivedSpan};

const SERVER: i32 = 2;
const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;

/// The hops of one message, each the child of the one before: (service, span, kind).
const PATH: [(&str, &str, i32); 4] = [
    ("chat-consumers", "POST /chats/{id}/messages", SERVER),
    ("cdc-relay", "outbox publish", PRODUCER),
    ("chat-workers", "inbox record", CONSUMER),
    ("chat-workers", "sse push", PRODUCER),
];

/// The spans of trace `trace_id` along [`PATH`], the first under `root_parent`, if all
/// arrived.
fn chain<'a>(
    spans: &'a [ReceivedSpan],
    trace_id: &str,
    root_parent: &str,
) -> Option<Vec<&'a ReceivedSpan>> {
    let mut parent = root_parent.to_string();
    let mut found = Vec::new();
    for (service, name, kind) in PATH {
        let span = spans.iter().find(|s| {
            s.trace_id == trace_id
                && s.parent_span_id == parent
                && s.service == service
                && s.name == name
                && s.kind == kind
        })?;
        parent = span.span_id.clone();
        found.push(span);
    }
    Some(found)
}

async fn post(consumers: &mut Connection, body: &str, headers: &[(&str, &str)]) -> String {
    let reply = consumers
        .post_json_with(
            "/chats/1/messages",
            &serde_json::json!({ "body": body }),
            headers,
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 201, "{}", reply.body);
    reply.json()["id"].as_str().unwrap().to_string()
}

async fn shown(client: &mut SseClient, id: &str) {
    loop {
        let event = client
            .next(Duration::from_secs(20))
            .await
            .expect("the message shown on Workers");
        let data: serde_json::Value = serde_json::from_str(&event.data).unwrap();
        if data["id"] == id {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_is_one_trace_from_the_request_to_the_live_push() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let system = System::new(false, bins()).await.unwrap();
    // Export within 100 ms of a span ending rather than the default 5 s.
    system.set_env("OTEL_BSP_SCHEDULE_DELAY", "100");
    let otlp = ["--otlp-endpoint".to_string(), receiver.endpoint()];
    system
        .start("relay-consumers", Kind::Relay(Side::Consumers), &otlp)
        .unwrap();
    system
        .wait_relay("relay-consumers", Duration::from_secs(30))
        .await
        .unwrap();
    // The first instance sits behind a front end whose traceparent it continues; the
    // second, facing clients directly, starts traces of its own.
    let trusting: Vec<String> = otlp
        .iter()
        .cloned()
        .chain(["--trust-traceparent".to_string()])
        .collect();
    system
        .start("consumers", Kind::Service(Side::Consumers), &trusting)
        .unwrap();
    system
        .start("workers", Kind::Service(Side::Workers), &otlp)
        .unwrap();
    for side in [Side::Consumers, Side::Workers] {
        system
            .wait_service(side, Duration::from_secs(30))
            .await
            .unwrap();
    }
    // Started once the first holds Consumers' inbox lease, so it stands by (wait_service
    // above waits for an active consumer).
    system
        .start("consumers-2", Kind::Instance(Side::Consumers, 1), &otlp)
        .unwrap();
    system
        .wait_instance(Side::Consumers, 1, Duration::from_secs(30))
        .await
        .unwrap();
    let mut client =
        SseClient::connect(system.service_addr(Side::Workers), "/chats/1/events", None)
            .await
            .unwrap();
    let mut consumers = Connection::open(system.service_addr(Side::Consumers))
        .await
        .unwrap();

    let (trace_id, caller) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let traceparent = format!("00-{trace_id}-{caller}-01");
    let id = post(&mut consumers, "traced", &[("traceparent", &traceparent)]).await;
    shown(&mut client, &id).await;
    let spans = receiver
        .wait_for(
            Duration::from_secs(30),
            "the traced message's spans, request to push",
            |spans| chain(spans, trace_id, caller).is_some(),
        )
        .await;
    let hops = chain(&spans, trace_id, caller).unwrap();
    for pair in hops.windows(2) {
        // A hop starts after its parent did (one clock: all on this machine).
        assert!(
            pair[1].start_unix_nanos >= pair[0].start_unix_nanos,
            "{pair:#?}"
        );
    }
    for hop in &hops {
        assert!(hop.end_unix_nanos >= hop.start_unix_nanos, "{hop:#?}");
    }

    // Without a traceparent the request starts a trace of its own, which goes the same
    // way; so does one the instance does not trust, linking to the client's context.
    let untraced = post(&mut consumers, "untraced", &[]).await;
    shown(&mut client, &untraced).await;
    let mut facing = Connection::open(system.instance_addr(Side::Consumers, 1))
        .await
        .unwrap();
    let stranger = "00-1f2e3d4c5b6a79881f2e3d4c5b6a7988-1122334455667788-01";
    let untrusted = post(&mut facing, "untrusted", &[("traceparent", stranger)]).await;
    shown(&mut client, &untrusted).await;
    let roots = |spans: &[ReceivedSpan]| -> Vec<ReceivedSpan> {
        spans
            .iter()
            .filter(|s| s.kind == SERVER && s.parent_span_id.is_empty())
            .filter(|s| chain(spans, &s.trace_id, "").is_some())
            .cloned()
            .collect()
    };
    receiver
        .wait_for(
            Duration::from_secs(30),
            "new traces for the message sent without a traceparent and the untrusted one",
            |spans| roots(spans).len() == 2,
        )
        .await;
    // Stopped, every process flushed what it held: nothing more than one span per hop per
    // message arrived.
    system.shutdown();
    let spans = receiver.spans();
    assert_eq!(spans.len(), 3 * PATH.len(), "{spans:#?}");
    let started = roots(&spans);
    assert_eq!(started.len(), 2, "{spans:#?}");
    let stranger_trace = "1f2e3d4c5b6a79881f2e3d4c5b6a7988";
    assert!(started
        .iter()
        .all(|s| s.trace_id != trace_id && s.trace_id != stranger_trace));
    let linked: Vec<&ReceivedSpan> = started
        .iter()
        .filter(|s| s.links == [(stranger_trace.to_string(), "1122334455667788".to_string())])
        .collect();
    assert_eq!(linked.len(), 1, "{started:#?}");
    assert!(started.iter().any(|s| s.links.is_empty()), "{started:#?}");
}
