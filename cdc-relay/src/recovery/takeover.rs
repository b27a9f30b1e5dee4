//! Taking the slot over: everything between "connected" and "streaming", in three steps.
//!
//! 1. [`read_state`]: the database's prerequisites, the slot (read first), every shard's
//!    record (read second, each within the Redis timeout: a shard that does not answer starts
//!    behind instead of holding the others back) and the server's identity, on a gated
//!    replication session.
//! 2. [`decide_under_lock`]: what to do with each shard, and with the slot
//!    ([`decide`](super::decide)). Making the slot anew is decided only after taking the
//!    rebuild lock and reading the slot and Redis again in that order, and only while no
//!    other walsender holds the slot, so a standby never touches the records. It runs there,
//!    under the lock ([`rebuild`](super::rebuild)); nothing is republished there.
//! 3. [`start`]: adopt a new timeline or refuse, start replication, release the lock once
//!    streaming started, claim the live shards (and read them again after the claim), and
//!    hand the session to the streaming loop with the shards that start behind.
//!
//! The lock lives in [`take_over`]'s scope: whatever way out a step takes, it is released
//! (and Redis has confirmed it) before the error reaches the supervisor, which may end the
//! process at once.

use outbox_core::stream::EntryId;
use pgwire_replication::ReplicationClient;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::decide::{decide, decide_slot, Decision, Server};
use super::rebuild::{self, Reason};
use super::routes::Routes;
use crate::config::{OnLostSlot, RelayConfig};
use crate::context::Context;
use crate::error::RelayError;
use crate::sink::layout::Layout;
use crate::sink::{NewRecord, Publisher, RebuildLock, Records, StreamRecord};
use crate::source::{
    check_prerequisites, replication_config, replication_error, slot_info, Origin,
    ReplicationPhase, SlotInfo, Watermark,
};

/// A replication session that took the slot and started streaming, and where the stream's
/// new ids go.
pub(crate) struct Started {
    pub(crate) client: ReplicationClient,
    /// The session's publisher: its id offset, the live shards claimed.
    pub(crate) publisher: Publisher,
    pub(crate) origin: Origin,
    /// Each shard's top when the session decided to stream: a live shard must still hold it.
    pub(crate) tops: Vec<EntryId>,
    /// The shards that start behind (caught up from the outbox table).
    pub(crate) behind: Vec<u32>,
    /// Each live shard's recorded watermark, read after its claim: every row it shows is in
    /// the shard (or consumed), under whatever id a catch-up gave it.
    pub(crate) held: Vec<Option<Watermark>>,
}

/// What step 1 read, in that order.
struct State {
    sql: Client,
    records: Vec<Records>,
    slot: Option<SlotInfo>,
    /// Each shard's record, `None` where Redis did not answer.
    all: Vec<Option<StreamRecord>>,
    client: ReplicationClient,
    origin: Origin,
    server: Server,
    /// The lane the rebuild lock lives beside.
    anchor: usize,
    /// The session's routes (when routed), each with where it was first seen.
    routes: Routes,
}

/// Connect, take the slot (making it anew first when needed) and start streaming.
/// `shutdown` is heard at every step: whatever a step did is safe to leave (markers resume
/// it), so it is dropped where it stands.
pub(crate) async fn take_over(
    ctx: &Context,
    publisher: Publisher,
    shutdown: &CancellationToken,
) -> Result<Started, RelayError> {
    let mut lock = None;
    let steps = async {
        let (mut state, publisher) = read_state(ctx, publisher).await?;
        let plan = decide_under_lock(ctx, &mut state, &publisher, &mut lock).await?;
        start(ctx, state, publisher, plan, &mut lock).await
    };
    let started = tokio::select! {
        biased;
        _ = shutdown.cancelled() => Err(RelayError::ShuttingDown),
        started = steps => started,
    };
    if let Some(lock) = lock {
        lock.release().await;
    }
    started
}

/// Step 1: the prerequisites, the routes (when routed), the slot, then Redis, then the
/// server; the publisher, for the session's routes.
async fn read_state(ctx: &Context, publisher: Publisher) -> Result<(State, Publisher), RelayError> {
    let cfg = &ctx.config;
    let pg = &cfg.postgres;
    let sql = pg.endpoint.connect(cfg.connect_timeout).await?;
    ctx.set_postgres_reachable(true);
    check_prerequisites(&sql, pg).await?;
    let row = sql.query_one("SELECT pg_is_in_recovery()", &[]).await?;
    let in_recovery: bool = row.get(0);
    let (publisher, routes) = if publisher.layout().is_routed() {
        let routes = super::routes::load(ctx, &sql, &publisher).await?;
        let layout = Layout::new(&cfg.stream, cfg.stream_shards, routes.keys().cloned());
        (publisher.with_layout(layout), routes)
    } else {
        (publisher, Routes::default())
    };
    ctx.set_layout(publisher.layout().clone());
    let mut records = publisher.records();
    let slot = read_slot(ctx, &sql, in_recovery).await?;
    // The lock and the records together: a node that does not answer costs one timeout.
    let mut lock_shard = publisher.records_of(publisher.anchor());
    let (elsewhere, all) = futures::future::join(
        rebuild_elsewhere(ctx, std::slice::from_mut(&mut lock_shard)),
        read_each(ctx, &mut records),
    )
    .await;
    if elsewhere? {
        return Err(busy(ctx, None));
    }
    let all = all?;
    let readable: Vec<StreamRecord> = all.iter().flatten().cloned().collect();
    publisher.clone().check_layout(&all).await?;
    publisher.check_functions().await?;

    let replication = replication_config(
        &pg.endpoint,
        &pg.slot,
        &pg.publication,
        cfg.status_interval,
        cfg.replication_timeout,
    )
    .with_buffer_size(REPLICATION_BUFFER_EVENTS)
    .with_max_message_size(cfg.max_row_bytes);
    let mut client = ReplicationClient::connect_gated(replication).await?;
    let (origin, server_lsn) = Origin::identify(&mut client, cfg.connect_timeout).await?;
    let server = Server {
        lsn: server_lsn,
        in_recovery,
    };
    if let Some(recorded) = readable
        .iter()
        .filter_map(|r| r.system_id.as_ref())
        .find(|s| **s != origin.system_id)
    {
        return Err(RelayError::OriginMismatch {
            stream: publisher.stream().to_string(),
            stream_system: recorded.clone(),
            server_system: origin.system_id.clone(),
        });
    }
    Ok((
        State {
            sql,
            records,
            slot,
            all,
            client,
            origin,
            server,
            anchor: publisher.anchor() as usize,
            routes,
        },
        publisher,
    ))
}

/// The lanes of a route first seen at or after the slot's position start there, live, with a
/// record made now: everything of the route is still to come from the slot (a route is
/// registered before anything of it is acknowledged, at the position of its first row or,
/// for a message prefix, past the slot's), so nothing is owed from the table. Only lanes
/// decided behind for want of a record, with no entries, on a primary whose slot this
/// session holds (the position read now cannot move under it, and the server is no older
/// than any record: `refuse_to_start` passed), not after a rebuild; any other lane without a
/// record (Redis lost it) stays behind and is caught up from the table.
#[allow(clippy::too_many_arguments)]
async fn start_new_routes(
    ctx: &Context,
    sql: &Client,
    publisher: &Publisher,
    routes: &Routes,
    records: &mut [Records],
    all: &mut [Option<StreamRecord>],
    plan: &mut Plan,
    origin: &Origin,
    server: Server,
) -> Result<(), RelayError> {
    let layout = publisher.layout();
    if !layout.is_routed() || server.in_recovery || plan.rebuilt.is_some() {
        return Ok(());
    }
    let new_lanes: Vec<usize> = (0..layout.lanes() as usize)
        .filter(|&k| {
            plan.decisions[k] == Decision::Behind(Reason::NoRecord)
                && all[k].as_ref().is_some_and(|r| !r.exists() && r.len == 0)
        })
        .collect();
    if new_lanes.is_empty() {
        return Ok(());
    }
    let Some(confirmed) = slot_info(sql, &ctx.config.postgres.slot)
        .await?
        .filter(|s| !s.is_lost())
        .and_then(|s| s.confirmed_flush_lsn)
    else {
        return Ok(());
    };
    for k in new_lanes {
        let first_seen = routes.get(layout.route_of(k as u32)).copied().unwrap_or(0);
        if first_seen < confirmed.as_u64() {
            continue;
        }
        let created = records[k]
            .create(&NewRecord {
                origin,
                shards: layout.shards(),
                acked_through: confirmed.as_u64(),
                id_offset: plan.id_offset,
                last_id: None,
                watermark: None,
                rebuilding: None,
            })
            .await?;
        if !created {
            // A record appeared since the lane was read (another session made it): the lane
            // was judged without it and stays behind; its catch-up reads the record again
            // (and compares with what the stream holds) before it streams.
            warn!(stream = %publisher.shard_stream(k as u32), "a new route's record appeared meanwhile; its lane stays behind");
            continue;
        }
        info!(stream = %publisher.shard_stream(k as u32), at = %confirmed, "a new route's stream starts at the slot's position");
        let record = records[k].read().await?;
        plan.tops[k] = record.top;
        all[k] = Some(record);
        plan.decisions[k] = Decision::Stream;
    }
    Ok(())
}

/// Events the replication connection buffers: with rows of at most `--max-row-bytes`, this
/// times it bounds that buffer's memory.
pub(crate) const REPLICATION_BUFFER_EVENTS: usize = 64;

/// Every shard's record, each within the Redis timeout; `None` for a shard that did not
/// answer (it starts behind), an error when none did.
async fn read_each(
    ctx: &Context,
    records: &mut [Records],
) -> Result<Vec<Option<StreamRecord>>, RelayError> {
    let timeout = ctx.config.redis_timeout;
    let mut all = Vec::with_capacity(records.len());
    let mut last_error = None;
    // All at once: shards on a node that does not answer cost one timeout, not one each.
    let reads = futures::future::join_all(
        records
            .iter_mut()
            .map(|r| tokio::time::timeout(timeout, r.read())),
    )
    .await;
    for (k, read) in reads.into_iter().enumerate() {
        match read {
            Ok(Ok(record)) => all.push(Some(record)),
            Ok(Err(e)) if e.is_transient() => {
                warn!(shard = k, error = %e, "the shard's record cannot be read; it starts behind");
                last_error = Some(e);
                all.push(None);
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                warn!(
                    shard = k,
                    ?timeout,
                    "the shard's record did not come; it starts behind"
                );
                all.push(None);
            }
        }
    }
    if all.iter().all(Option::is_none) {
        return Err(last_error.unwrap_or(RelayError::ShardUnreachable {
            stream: records[0].stream().to_string(),
        }));
    }
    Ok(all)
}

/// What step 2 decided.
struct Plan {
    /// Per shard.
    decisions: Vec<Decision>,
    /// The slot-wide one, if any.
    slot: Option<Decision>,
    id_offset: u64,
    tops: Vec<EntryId>,
    /// The slot was made anew here.
    rebuilt: Option<Reason>,
}

/// Step 2: the decisions, and making the slot anew when they call for it, under the rebuild
/// lock (taken into `held`).
async fn decide_under_lock(
    ctx: &Context,
    state: &mut State,
    publisher: &Publisher,
    held: &mut Option<RebuildLock>,
) -> Result<Plan, RelayError> {
    let plan = plan(state, &ctx.config.postgres.slot);
    let Some(Decision::Reslot(reason)) = plan.slot else {
        return Ok(plan);
    };
    refuse_lost_slot(ctx, reason)?;
    if let Some(k) = state.all.iter().position(Option::is_none) {
        // Making the slot anew marks every shard: it waits until every one answers.
        return Err(RelayError::ShardUnreachable {
            stream: publisher.shard_stream(k as u32).to_string(),
        });
    }
    // The anchor's lock stands for the whole stream: there is one slot.
    let Some(lock) = RebuildLock::acquire(
        publisher.connection(),
        publisher.shard_stream(publisher.anchor()),
        ctx.instance_id(),
        ctx.config.rebuild_lock_ttl,
    )
    .await?
    else {
        return Err(busy(ctx, None));
    };
    let lock = held.insert(lock);
    // With the lock, both again in the same order: only now is it decided.
    state.slot = read_slot(ctx, &state.sql, state.server.in_recovery).await?;
    let mut all = Vec::with_capacity(state.records.len());
    for r in state.records.iter_mut() {
        all.push(Some(r.read().await?));
    }
    state.all = all;
    let mut plan = plan_of(state, &ctx.config.postgres.slot);
    if let Some(Decision::Reslot(reason)) = plan.slot {
        refuse_lost_slot(ctx, reason)?;
        warn!(slot = %ctx.config.postgres.slot, stream = %publisher.stream(), shards = publisher.shard_count(), reason = reason.as_str(), why = reason.explain(), "making the slot anew; every shard is caught up from the outbox table");
        let records: Vec<StreamRecord> = state.all.iter().flatten().cloned().collect();
        let id_offset = rebuild::rebuild(
            ctx,
            &mut state.client,
            publisher,
            &state.origin,
            &records,
            lock,
            reason,
        )
        .await?;
        ctx.set_slot_lost(false);
        plan.id_offset = id_offset;
        plan.rebuilt = Some(reason);
        plan.slot = None;
        plan.decisions = vec![Decision::Behind(reason); records.len()];
    }
    Ok(plan)
}

fn plan(state: &State, slot_name: &str) -> Plan {
    plan_of(state, slot_name)
}

fn plan_of(state: &State, slot_name: &str) -> Plan {
    let decisions: Vec<Decision> = state
        .all
        .iter()
        .map(|record| match record {
            Some(record) => {
                match decide(state.slot.as_ref(), record, &state.origin, state.server) {
                    // Only the slot the stream was read from counts as dropped: a relay given
                    // another name (a typo, another deployment's) must not make a slot of it.
                    Decision::Reslot(Reason::SlotDropped)
                        if record.slot.as_deref() != Some(slot_name) =>
                    {
                        Decision::SlotMissing
                    }
                    decision => decision,
                }
            }
            // Read when it answers, by its catch-up.
            None => Decision::Behind(Reason::FellBehind),
        })
        .collect();
    let readable = state.all.iter().flatten();
    Plan {
        slot: decide_slot(&decisions),
        decisions,
        id_offset: readable.clone().map(|r| r.id_offset).max().unwrap_or(0),
        tops: state
            .all
            .iter()
            .map(|r| r.as_ref().map(|r| r.top).unwrap_or_default())
            .collect(),
        rebuilt: None,
    }
}

/// Step 3: act on the decisions and start replication; the lock (if any) is released as
/// soon as streaming started.
async fn start(
    ctx: &Context,
    state: State,
    publisher: Publisher,
    plan: Plan,
    held: &mut Option<RebuildLock>,
) -> Result<Started, RelayError> {
    let State {
        sql,
        mut records,
        mut all,
        mut client,
        origin,
        server,
        anchor,
        routes,
        ..
    } = state;
    let mut plan = plan;
    refuse_to_start(&ctx.config, &plan, &all, &origin, publisher.stream())?;
    adopt_timelines(&mut records, &plan, &all, &origin, publisher.stream()).await?;
    start_replication(
        ctx,
        &sql,
        &mut client,
        std::slice::from_mut(&mut records[anchor]),
        &server,
        held,
    )
    .await?;
    // Another relay may have begun making the slot anew between our decision and START
    // (it dropped and made the slot we now hold): leave the stream to it.
    // (Not when the anchor did not answer: no rebuild begins without it.)
    if plan.rebuilt.is_none()
        && all[anchor].is_some()
        && rebuild_elsewhere(ctx, std::slice::from_mut(&mut records[anchor])).await?
    {
        return Err(busy(ctx, None));
    }
    start_new_routes(
        ctx,
        &sql,
        &publisher,
        &routes,
        &mut records,
        &mut all,
        &mut plan,
        &origin,
        server,
    )
    .await?;
    drop(sql);
    // Holding the slot: claim each live shard, so a relay that held it before (paused, cut
    // off) writes nothing more there. (A shard behind is claimed by its catch-up.)
    let mut publisher = publisher.for_session(plan.id_offset);
    let live = shards_where(&plan, |d| matches!(d, Decision::Stream | Decision::Adopt));
    for &k in &live {
        publisher
            .claim_writer_epoch(k, &ctx.config.postgres.slot)
            .await?;
    }
    let held_rows = reread_live(&mut records, &all, &live, &plan).await?;
    let behind = shards_where(&plan, |d| matches!(d, Decision::Behind(_)));
    if plan.rebuilt.is_none() {
        count_behind(ctx, &plan);
    }
    info!(
        slot = %ctx.config.postgres.slot,
        stream = %publisher.stream(),
        shards = publisher.shard_count(),
        routes = ?publisher.layout().routes(),
        behind = ?behind,
        system_id = %origin.system_id,
        timeline = origin.timeline,
        id_offset = plan.id_offset,
        "acquired slot; streaming"
    );
    Ok(Started {
        client,
        publisher,
        origin,
        tops: plan.tops,
        behind,
        held: held_rows,
    })
}

/// The decisions that stop the relay before it streams: the slot is missing, a standby
/// awaits promotion, or the stream is on a newer timeline than the server.
fn refuse_to_start(
    cfg: &RelayConfig,
    plan: &Plan,
    all: &[Option<StreamRecord>],
    origin: &Origin,
    stream: &str,
) -> Result<(), RelayError> {
    let slot = || cfg.postgres.slot.clone();
    match plan.slot {
        Some(Decision::SlotMissing) => Err(RelayError::SlotMissing { slot: slot() }),
        Some(Decision::AwaitPromotion) => Err(RelayError::AwaitingPromotion {
            slot: slot(),
            synced_copy: false,
        }),
        Some(Decision::OlderTimeline) => Err(RelayError::OlderTimeline {
            stream: stream.to_string(),
            recorded: all
                .iter()
                .flatten()
                .filter_map(|r| r.timeline)
                .max()
                .unwrap_or_default(),
            server: origin.timeline,
        }),
        _ => Ok(()),
    }
}

/// Adopt the server's timeline in the records of shards decided `Adopt`: their timeline is
/// an ancestor whose switch point is past everything they acknowledged.
async fn adopt_timelines(
    records: &mut [Records],
    plan: &Plan,
    all: &[Option<StreamRecord>],
    origin: &Origin,
    stream: &str,
) -> Result<(), RelayError> {
    let mut adopted = false;
    for ((r, decision), record) in records.iter_mut().zip(&plan.decisions).zip(all) {
        if *decision == Decision::Adopt {
            let agrees_through = origin
                .history
                .agrees_through(record.as_ref().and_then(|rec| rec.timeline));
            adopted |= r.adopt_timeline(origin, agrees_through).await?;
        }
    }
    if adopted {
        info!(%stream, timeline = origin.timeline, "the stream continues on the server's new timeline (its switch point is past everything the stream acknowledged)");
    }
    Ok(())
}

/// START_REPLICATION, and wait (bounded) until the server streams; the rebuild lock goes as
/// soon as it answered. A refusal is classified for the operator: a standby's synced copy
/// awaits promotion, a slot gone in another relay's drop and create is busy, not missing.
async fn start_replication(
    ctx: &Context,
    sql: &Client,
    client: &mut ReplicationClient,
    // The anchor's alone: the rebuild lock lives beside its record.
    records: &mut [Records],
    server: &Server,
    held: &mut Option<RebuildLock>,
) -> Result<(), RelayError> {
    let cfg = &ctx.config;
    let pg = &cfg.postgres;
    client.start().await?;
    let started = within(cfg, client.wait_started()).await;
    if let Some(lock) = held.take() {
        lock.release().await;
    }
    let Err(e) = started? else {
        return Ok(());
    };
    let holder = slot_info(sql, &pg.slot)
        .await
        .ok()
        .flatten()
        .and_then(|s| s.active_pid)
        .map(|pid| pid as u32);
    let recover = cfg.on_lost_slot == OnLostSlot::Recover;
    Err(
        match replication_error(e, ReplicationPhase::Start, pg, recover, holder) {
            // On a standby, "cannot use the slot" is its synced copy (17+: "being
            // synchronized from the primary"), not an invalidated slot.
            RelayError::SlotLost { .. } if server.in_recovery => RelayError::AwaitingPromotion {
                slot: pg.slot.clone(),
                synced_copy: true,
            },
            // Gone in another relay's drop→create window, or the anchor cannot say: stand by
            // (retried), not a missing slot that needs a human.
            RelayError::SlotMissing { .. }
                if rebuild_lock(ctx, records).await.ok().flatten() != Some(false) =>
            {
                busy(ctx, None)
            }
            e => e,
        },
    )
}

/// The shards whose decision `which` takes.
fn shards_where(plan: &Plan, which: impl Fn(&Decision) -> bool) -> Vec<u32> {
    plan.decisions
        .iter()
        .enumerate()
        .filter(|(_, d)| which(d))
        .map(|(k, _)| k as u32)
        .collect()
}

/// Say (and count, per reason) why shards start behind.
fn count_behind(ctx: &Context, plan: &Plan) {
    let mut reasons: Vec<Reason> = plan
        .decisions
        .iter()
        .filter_map(|d| match d {
            Decision::Behind(r) => Some(*r),
            _ => None,
        })
        .collect();
    reasons.dedup();
    for reason in reasons {
        warn!(
            reason = reason.as_str(),
            why = reason.explain(),
            "shards start behind; they are caught up from the outbox table while the others stream"
        );
        ctx.metrics
            .rebuilds_total
            .with_label_values(&[reason.as_str()])
            .inc();
    }
}

/// What the decision rested on, read again after the claims: a relay that wrote (or rebuilt)
/// in between is fenced now, but what it wrote is not what was decided on. Answers each
/// live shard's watermark whose rows the session need not send again (see `Started::held`).
async fn reread_live(
    records: &mut [Records],
    all: &[Option<StreamRecord>],
    live: &[u32],
    plan: &Plan,
) -> Result<Vec<Option<Watermark>>, RelayError> {
    let mut held = vec![None; plan.tops.len()];
    for &k in live {
        let now = records[k as usize].read().await?;
        let before = all[k as usize].as_ref();
        if before.is_some_and(|b| b.top != now.top || b.id_offset != now.id_offset)
            || now.rebuilding.is_some()
        {
            return Err(RelayError::Restart(format!(
                "shard {k} changed while this relay took the slot over"
            )));
        }
        // Every recorded watermark's transaction ids still mean what they meant on this
        // server: it was recorded only once the WAL through its `hi` was flushed (with an
        // acknowledgement past it, or after waiting for the flush: `source::wait_durable`),
        // so no crash loses a commit it shows nor gives out again an id it saw end; and a
        // timeline adopted since forgot every watermark past where the histories agree
        // (`Records::adopt_timeline`). A shard not decided `Stream` holds nothing: its
        // replays are sent, and refused or caught up as before.
        if matches!(plan.decisions[k as usize], Decision::Stream) {
            held[k as usize] = now.watermark;
        }
    }
    Ok(held)
}

/// The slot as Postgres shows it; a slot held by another walsender means standing by, and a
/// standby's synced copy of the primary's slot waiting for the standby's promotion.
async fn read_slot(
    ctx: &Context,
    sql: &tokio_postgres::Client,
    in_recovery: bool,
) -> Result<Option<SlotInfo>, RelayError> {
    let pg = &ctx.config.postgres;
    let slot = crate::source::check_slot(sql, pg).await?;
    if in_recovery && slot.as_ref().is_some_and(|s| s.synced == Some(true)) {
        return Err(RelayError::AwaitingPromotion {
            slot: pg.slot.clone(),
            synced_copy: true,
        });
    }
    if let Some(pid) = slot.as_ref().and_then(|s| s.active_pid) {
        return Err(busy(ctx, Some(pid as u32)));
    }
    let lost = slot.as_ref().is_some_and(SlotInfo::is_lost);
    ctx.set_slot_lost(lost);
    if pg.failover && slot.as_ref().is_some_and(|s| s.failover == Some(false)) {
        warn!(slot = %pg.slot, "--failover is set but the slot is not a failover slot: a primary failover loses it (see `cdc-relay setup --failover`)");
    }
    if lost {
        // Said at once, whatever state Redis is in.
        refuse_lost_slot(ctx, Reason::LostSlot)?;
    }
    Ok(slot)
}

fn refuse_lost_slot(ctx: &Context, reason: Reason) -> Result<(), RelayError> {
    if ctx.config.on_lost_slot == OnLostSlot::Recover {
        return Ok(());
    }
    let slot = ctx.config.postgres.slot.clone();
    match reason {
        Reason::LostSlot => Err(RelayError::SlotLost {
            slot,
            recover: false,
        }),
        Reason::SlotDropped => Err(RelayError::SlotDropped { slot }),
        _ => Ok(()),
    }
}

/// Whether another relay is making the slot anew: it holds the rebuild lock (on shard 0).
/// Shard 0 not answering within the Redis timeout counts as no: no rebuild can begin without
/// taking that lock, one under way stops at its next step once it cannot extend it, and the
/// slot itself admits one session at a time; waiting would hold every other shard back for
/// as long as that one node is gone.
async fn rebuild_elsewhere(ctx: &Context, records: &mut [Records]) -> Result<bool, RelayError> {
    Ok(rebuild_lock(ctx, records).await?.unwrap_or(false))
}

/// Whether another relay holds the rebuild lock (`records`: the anchor's alone); `None` when
/// it does not answer within the Redis timeout (said in the log).
async fn rebuild_lock(ctx: &Context, records: &mut [Records]) -> Result<Option<bool>, RelayError> {
    let timeout = ctx.config.redis_timeout;
    match tokio::time::timeout(timeout, records[0].rebuilding_elsewhere(ctx.instance_id())).await {
        Ok(Ok(elsewhere)) => Ok(Some(elsewhere)),
        Ok(Err(e)) if e.is_transient() => {
            warn!(error = %e, "the rebuild lock cannot be read; going on without it");
            Ok(None)
        }
        Ok(Err(e)) => Err(e),
        Err(_) => {
            warn!(
                ?timeout,
                "the rebuild lock did not answer; going on without it"
            );
            Ok(None)
        }
    }
}

fn busy(ctx: &Context, holder: Option<u32>) -> RelayError {
    RelayError::SlotBusy {
        slot: ctx.config.postgres.slot.clone(),
        holder,
    }
}

async fn within<T>(
    cfg: &RelayConfig,
    fut: impl std::future::Future<Output = T>,
) -> Result<T, RelayError> {
    tokio::time::timeout(cfg.connect_timeout, fut)
        .await
        .map_err(|_| RelayError::ConnectTimeout(cfg.connect_timeout))
}
