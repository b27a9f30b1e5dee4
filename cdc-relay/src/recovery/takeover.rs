//! Taking the slot over: everything between "connected" and "streaming", in three steps.
//!
//! 1. [`read_state`]: the database's prerequisites, the slot (read first), every shard's
//!    record (read second) and the server's identity, on a gated replication session.
//! 2. [`decide_under_lock`]: what to do ([`decide`](super::decide)); a rebuild is decided
//!    only after taking the rebuild lock and reading the slot and Redis again in that order,
//!    and only while no other walsender holds the slot, so a standby never touches the
//!    record. A rebuild runs there, under the lock.
//! 3. [`start`]: adopt a new timeline or refuse, start replication, release the lock once
//!    streaming started, and hand the session to the streaming loop.
//!
//! The lock lives in [`take_over`]'s scope: whatever way out a step takes, it is released
//! (and Redis has confirmed it) before the error reaches the supervisor, which may end the
//! process at once.

use outbox_core::stream::EntryId;
use pgwire_replication::ReplicationClient;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::decide::{decide_shards, Decision, Server};
use super::rebuild::{self, Reason};
use crate::config::{OnLostSlot, RelayConfig};
use crate::context::Context;
use crate::error::RelayError;
use crate::sink::{read_all, Publisher, RebuildLock, Records, StreamRecord};
use crate::source::{
    check_prerequisites, check_slot, replication_config, replication_error, slot_info, Origin,
    ReplicationPhase, SlotInfo,
};

/// A replication session that took the slot and started streaming, and where the stream's
/// new ids go.
pub(crate) struct Started {
    pub(crate) client: ReplicationClient,
    pub(crate) publisher: Publisher,
    pub(crate) origin: Origin,
    /// Added to commit LSNs to make stream ids (see the record).
    pub(crate) id_offset: u64,
    /// Each shard's top when the session decided to stream: it must still hold it.
    pub(crate) tops: Vec<EntryId>,
}

/// What step 1 read, in that order.
struct State {
    sql: Client,
    records: Vec<Records>,
    slot: Option<SlotInfo>,
    all: Vec<StreamRecord>,
    client: ReplicationClient,
    origin: Origin,
    server: Server,
}

/// Connect, take the slot (rebuilding the stream first when needed) and start streaming.
/// `shutdown` is heard at every step: whatever a step did is safe to leave (a rebuild
/// resumes from its marker), so it is dropped where it stands.
pub(crate) async fn take_over(
    ctx: &Context,
    mut publisher: Publisher,
    shutdown: &CancellationToken,
) -> Result<Started, RelayError> {
    let mut lock = None;
    let steps = async {
        let mut state = read_state(ctx, &mut publisher).await?;
        let (decision, placement) =
            decide_under_lock(ctx, &mut state, &mut publisher, &mut lock).await?;
        start(ctx, state, publisher, decision, placement, &mut lock).await
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

/// Step 1: the prerequisites, the slot, then Redis, then the server.
async fn read_state(ctx: &Context, publisher: &mut Publisher) -> Result<State, RelayError> {
    let cfg = &ctx.config;
    let pg = &cfg.postgres;
    let sql = pg.endpoint.connect(cfg.connect_timeout).await?;
    ctx.set_postgres_reachable(true);
    check_prerequisites(&sql, pg).await?;
    let in_recovery: bool = sql
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await?
        .get(0);
    let mut records = publisher.records();
    let slot = read_slot(ctx, &sql, in_recovery).await?;
    if records[0].rebuilding_elsewhere(ctx.instance_id()).await? {
        return Err(busy(ctx, None));
    }
    let all = read_all(&mut records).await?;
    publisher.check_layout(&all).await?;

    let replication =
        replication_config(&pg.endpoint, &pg.slot, &pg.publication, cfg.status_interval);
    let mut client = ReplicationClient::connect_gated(replication).await?;
    let (origin, server_lsn) = Origin::identify(&mut client, cfg.connect_timeout).await?;
    let server = Server {
        lsn: server_lsn,
        in_recovery,
    };
    if let Some(recorded) = all
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
    Ok(State {
        sql,
        records,
        slot,
        all,
        client,
        origin,
        server,
    })
}

/// Step 2: the decision, and the rebuild it may call for, under the rebuild lock (taken
/// into `held`).
async fn decide_under_lock(
    ctx: &Context,
    state: &mut State,
    publisher: &mut Publisher,
    held: &mut Option<RebuildLock>,
) -> Result<(Decision, Placement), RelayError> {
    let decision = decide_shards(state.slot.as_ref(), &state.all, &state.origin, state.server);
    let Decision::Rebuild(reason) = decision else {
        return Ok((decision, Placement::of(&state.all)));
    };
    refuse_lost_slot(ctx, reason)?;
    // Shard 0's lock stands for the whole stream: there is one slot to rebuild from.
    let Some(lock) = RebuildLock::acquire(
        publisher.connection(),
        publisher.shard_stream(0),
        ctx.instance_id(),
        ctx.config.rebuild_lock_ttl,
    )
    .await?
    else {
        return Err(busy(ctx, None));
    };
    let lock = held.insert(lock);
    // With the lock, both again in the same order: only now is a rebuild decided.
    state.slot = read_slot(ctx, &state.sql, state.server.in_recovery).await?;
    state.all = read_all(&mut state.records).await?;
    let decision = decide_shards(state.slot.as_ref(), &state.all, &state.origin, state.server);
    let mut placement = Placement::of(&state.all);
    if let Decision::Rebuild(reason) = decision {
        refuse_lost_slot(ctx, reason)?;
        warn!(slot = %ctx.config.postgres.slot, stream = %publisher.stream(), shards = publisher.shard_count(), reason = reason.as_str(), why = reason.explain(), "rebuilding the stream from the outbox table");
        let (id_offset, tops) = rebuild::rebuild(
            ctx,
            &mut state.client,
            publisher,
            &state.origin,
            &state.all,
            lock,
            reason,
        )
        .await?;
        placement = Placement { id_offset, tops };
        ctx.set_slot_lost(false);
    }
    Ok((decision, placement))
}

/// Step 3: act on the decision and start replication; the lock (if any) is released as
/// soon as streaming started.
async fn start(
    ctx: &Context,
    state: State,
    publisher: Publisher,
    decision: Decision,
    placement: Placement,
    held: &mut Option<RebuildLock>,
) -> Result<Started, RelayError> {
    let cfg = &ctx.config;
    let pg = &cfg.postgres;
    let State {
        sql,
        mut records,
        all,
        mut client,
        origin,
        server,
        ..
    } = state;
    match decision {
        Decision::SlotMissing => {
            return Err(RelayError::SlotMissing {
                slot: pg.slot.clone(),
            })
        }
        Decision::AwaitPromotion => {
            return Err(RelayError::AwaitingPromotion {
                slot: pg.slot.clone(),
                synced_copy: false,
            })
        }
        Decision::Adopt => {
            let mut adopted = false;
            for r in records.iter_mut() {
                adopted |= r.adopt_timeline(&origin).await?;
            }
            if adopted {
                info!(stream = %publisher.stream(), timeline = origin.timeline, "the stream continues on the server's new timeline (its switch point is past everything the stream acknowledged)");
            }
        }
        Decision::OlderTimeline => {
            return Err(RelayError::OlderTimeline {
                stream: publisher.stream().to_string(),
                recorded: all
                    .iter()
                    .filter_map(|r| r.timeline)
                    .max()
                    .unwrap_or_default(),
                server: origin.timeline,
            });
        }
        Decision::Stream | Decision::Rebuild(_) => {}
    }

    let rebuilt_here = matches!(decision, Decision::Rebuild(_));
    client.start().await?;
    let started = within(cfg, client.wait_started()).await;
    if let Some(lock) = held.take() {
        lock.release().await;
    }
    if let Err(e) = started? {
        let holder = slot_info(&sql, &pg.slot)
            .await
            .ok()
            .flatten()
            .and_then(|s| s.active_pid)
            .map(|pid| pid as u32);
        let recover = cfg.on_lost_slot == OnLostSlot::Recover;
        return Err(
            match replication_error(e, ReplicationPhase::Start, pg, recover, holder) {
                // On a standby, "cannot use the slot" is its synced copy (17+: "being
                // synchronized from the primary"), not an invalidated slot.
                RelayError::SlotLost { .. } if server.in_recovery => {
                    RelayError::AwaitingPromotion {
                        slot: pg.slot.clone(),
                        synced_copy: true,
                    }
                }
                e => e,
            },
        );
    }
    drop(sql);
    // Another relay may have started a rebuild between our decision and START (it dropped
    // and made the slot we now hold): leave the stream to it, without fencing it first.
    if !rebuilt_here && rebuild_elsewhere(ctx, &mut records).await? {
        return Err(busy(ctx, None));
    }
    // Holding the slot: claim the stream, so a relay that held it before (paused, cut off)
    // writes nothing more. A rebuild that began in between was fenced by the claim; look
    // again, and leave it the stream (it resumes).
    let mut publisher = publisher;
    publisher.claim_writer_epochs().await?;
    if !rebuilt_here && rebuild_elsewhere(ctx, &mut records).await? {
        return Err(busy(ctx, None));
    }
    info!(
        slot = %pg.slot,
        stream = %publisher.stream(),
        shards = publisher.shard_count(),
        system_id = %origin.system_id,
        timeline = origin.timeline,
        id_offset = placement.id_offset,
        "acquired slot; streaming"
    );
    Ok(Started {
        client,
        publisher,
        origin,
        id_offset: placement.id_offset,
        tops: placement.tops,
    })
}

/// Where new ids go: one offset for every shard (the largest recorded), and each shard's top.
struct Placement {
    id_offset: u64,
    tops: Vec<EntryId>,
}

impl Placement {
    fn of(records: &[StreamRecord]) -> Self {
        Self {
            id_offset: records.iter().map(|r| r.id_offset).max().unwrap_or(0),
            tops: records.iter().map(|r| r.top).collect(),
        }
    }
}

/// The slot as Postgres shows it; a slot held by another walsender means standing by, and a
/// standby's synced copy of the primary's slot waiting for the standby's promotion.
async fn read_slot(
    ctx: &Context,
    sql: &tokio_postgres::Client,
    in_recovery: bool,
) -> Result<Option<SlotInfo>, RelayError> {
    let pg = &ctx.config.postgres;
    let slot = match slot_info(sql, &pg.slot).await? {
        Some(_) => Some(check_slot(sql, pg).await?),
        None => None,
    };
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
    if reason == Reason::LostSlot && ctx.config.on_lost_slot == OnLostSlot::Fail {
        return Err(RelayError::SlotLost {
            slot: ctx.config.postgres.slot.clone(),
            recover: false,
        });
    }
    Ok(())
}

/// Whether a rebuild is under way by another relay: a shard's record carries its marker, or
/// another instance holds the rebuild lock.
async fn rebuild_elsewhere(ctx: &Context, records: &mut [Records]) -> Result<bool, RelayError> {
    let now = read_all(records).await?;
    Ok(now.iter().any(|r| r.rebuilding.is_some())
        || records[0].rebuilding_elsewhere(ctx.instance_id()).await?)
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
