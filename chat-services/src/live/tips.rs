//! The safety net under live hints: every subscribed chat's newest feed position, read
//! from the database now and then and handed to the hub, so a message whose hint never
//! came is shown within one period at the latest.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::hub::Hub;
use crate::store::Store;

/// Chats asked about per tip query.
const TIPS_PER_QUERY: usize = 10_000;

/// Every `every`, tell each subscribed chat's streams how far its feed reaches, so a
/// message whose hint never came (its writer killed between commit and hint, a hint lost
/// with Redis) is shown within `every` at the latest. One query per `TIPS_PER_QUERY` chats.
pub(crate) async fn watch_tips(
    store: Store,
    hub: Arc<Hub>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        for chats in hub.chat_ids().chunks(TIPS_PER_QUERY) {
            match store.tips(chats).await {
                Ok(tips) => {
                    if failing {
                        info!("feed tips readable again");
                        failing = false;
                    }
                    for (chat_id, pos) in tips {
                        hub.tip(chat_id, pos);
                    }
                }
                Err(e) => {
                    if !failing {
                        warn!(error = %e, "cannot read feed tips; live hints still flow");
                        failing = true;
                    }
                    break;
                }
            }
        }
    }
}
