//! A Redis client from a URL (`redis://`, `rediss://` for TLS, `redis+unix://`), with the
//! password optionally from a file and TLS verified against a CA file when one is given;
//! and one connection type for a single server or a Redis Cluster (`--redis-cluster`: the
//! URL names any node, redis-rs's cluster client finds the rest and follows MOVED/ASK and
//! failovers).

use std::path::Path;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterConfig;
use redis::cluster_routing::{SingleNodeRoutingInfo, Slot, SlotAddr};
use std::sync::{Arc, Mutex};

use redis::{Cmd, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisFuture, RedisResult, Value};

use super::pg::read_secret_file;
use crate::error::ConfigError;

/// Where Redis is: one server, or a cluster reached through any of its nodes.
#[derive(Clone)]
#[allow(clippy::large_enum_variant)] // built once per process, cloned rarely
pub enum RedisTarget {
    Single(redis::Client),
    /// A cluster: the nodes it was given, and those it learned since.
    Cluster(Arc<ClusterNodes>),
}

/// The nodes a cluster target connects through. Every connection it makes learns the
/// cluster's nodes (`CLUSTER SLOTS`), and the next one starts from all of them: redis-rs
/// reconnects through its initial nodes only, so a process given one seed address would
/// otherwise never connect again once that node is gone, while the rest of the cluster
/// serves.
pub struct ClusterNodes {
    /// The configured addresses, never forgotten.
    seeds: Vec<ConnectionInfo>,
    /// Seeds and learned nodes.
    known: Mutex<Vec<ConnectionInfo>>,
    timeout: Duration,
    root_cert: Option<Vec<u8>>,
    flag: String,
}

impl ClusterNodes {
    /// A client over every known node, speaking `protocol`.
    fn client(
        &self,
        protocol: redis::ProtocolVersion,
    ) -> RedisResult<redis::cluster::ClusterClient> {
        let nodes = self.known.lock().unwrap().clone();
        build_cluster_client(nodes, self.timeout, self.root_cert.as_ref(), protocol)
    }

    /// Learn the cluster's nodes through `conn`; a failure keeps what was known.
    async fn learn(&self, conn: &mut redis::cluster_async::ClusterConnection) {
        let slots: RedisResult<Value> = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await;
        let Ok(Value::Array(ranges)) = slots else {
            return;
        };
        let template = &self.seeds[0];
        let mut known = self.seeds.clone();
        for range in ranges {
            let Value::Array(parts) = range else { continue };
            for node in parts.into_iter().skip(2) {
                let Value::Array(fields) = node else { continue };
                let host: Option<String> = fields
                    .first()
                    .and_then(|v| redis::from_redis_value_ref(v).ok());
                let port: Option<u16> = fields
                    .get(1)
                    .and_then(|v| redis::from_redis_value_ref(v).ok());
                let (Some(host), Some(port)) = (host, port) else {
                    continue;
                };
                // An empty or unknown endpoint means "the node you asked": nothing to add.
                if host.is_empty() || host == "?" {
                    continue;
                }
                let info = with_address(template, host, port);
                if !known.iter().any(|k| k.addr() == info.addr()) {
                    known.push(info);
                }
            }
        }
        tracing::debug!(flag = %self.flag, nodes = known.len(), "learned the cluster's nodes");
        *self.known.lock().unwrap() = known;
    }
}

/// `template`'s connection settings (credentials, TLS) for another node's address.
fn with_address(template: &ConnectionInfo, host: String, port: u16) -> ConnectionInfo {
    let addr = match template.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host,
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host, port),
    };
    template.clone().set_addr(addr)
}

/// TCP keepalives and a user timeout on every Redis connection, and no Nagle delay: a
/// server host that vanished (a partition, a powered-off node, a middlebox that lost the
/// connection) fails it within about 10 s instead of the kernel's many minutes, and the
/// connection is made again. (A server that stops answering on a live host is the response
/// timeouts' to catch.)
fn tcp_deadlines() -> redis::io::tcp::TcpSettings {
    use redis::io::tcp::socket2::TcpKeepalive;
    redis::io::tcp::TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(
            TcpKeepalive::new()
                .with_time(Duration::from_secs(10))
                .with_interval(Duration::from_secs(2))
                .with_retries(3),
        )
        .set_user_timeout(Duration::from_secs(10))
}

/// How long a cluster client waits for a node to accept a connection (see its use).
const CLUSTER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The least and most a cluster client waits before it sends a failed request again (ms;
/// jittered, doubling from 10 ms per retry in between).
const CLUSTER_RETRY_WAIT_MS: (u64, u64) = (20, 250);

fn build_cluster_client(
    nodes: Vec<ConnectionInfo>,
    timeout: Duration,
    root_cert: Option<&Vec<u8>>,
    protocol: redis::ProtocolVersion,
) -> RedisResult<redis::cluster::ClusterClient> {
    let mut builder = redis::cluster::ClusterClientBuilder::new(nodes)
        .tcp_settings(tcp_deadlines())
        .response_timeout(timeout)
        // Short: while the client refreshes its slot map it connects to every node, a frozen
        // one too, and sends nothing meanwhile; a refresh that took the whole response
        // timeout would time out every request to the healthy nodes as well, and each
        // timeout starts the next refresh (one frozen host would stall the whole cluster).
        .connection_timeout(timeout.min(CLUSTER_CONNECT_TIMEOUT))
        // redis-rs retries a request that met a down node or CLUSTERDOWN by itself, after at
        // least 1.28 s each by default: a request sent during a cluster restart then waits
        // up to that long after the cluster is ok again (or its whole deadline, seen in the
        // soak). Short waits answer it within a quarter second of the cluster's return; the
        // callers' own backoff paces anything longer.
        .min_retry_wait(CLUSTER_RETRY_WAIT_MS.0)
        .max_retry_wait(CLUSTER_RETRY_WAIT_MS.1)
        .use_protocol(protocol);
    if let Some(root_cert) = root_cert {
        builder = builder.certs(redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root_cert.clone()),
        });
    }
    builder.build()
}

/// A connection to either (cheap to clone; both reconnect by themselves).
#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(SharedCluster),
}

/// A cluster connection shared by every clone, made anew once it has lost every node.
/// redis-rs leaves a cluster connection whose nodes all went away at once (a whole cluster
/// restarted) without any node to ask, and it then retries in a busy loop: every request fails
/// with "No connections found", one core spins, and it never recovers by itself. Measured in
/// the lab's cluster soak: four service instances logged 22 million such failures in 90 s and
/// received nothing until they were restarted. The first request that meets it starts one new
/// connection (at most one a second); the old one ends once its last request is done.
#[derive(Clone)]
pub struct SharedCluster(Arc<SharedClusterInner>);

struct SharedClusterInner {
    current: Mutex<redis::cluster_async::ClusterConnection>,
    /// How to make it anew (`None`: a connection made elsewhere, kept as it is).
    remake: Option<(Arc<ClusterNodes>, Duration)>,
    renewing: std::sync::atomic::AtomicBool,
    renewed_at: Mutex<Option<std::time::Instant>>,
}

impl SharedCluster {
    /// A connection made by someone else: never made anew.
    pub fn of(conn: redis::cluster_async::ClusterConnection) -> Self {
        Self::new(conn, None)
    }

    fn new(
        conn: redis::cluster_async::ClusterConnection,
        remake: Option<(Arc<ClusterNodes>, Duration)>,
    ) -> Self {
        Self(Arc::new(SharedClusterInner {
            current: Mutex::new(conn),
            remake,
            renewing: std::sync::atomic::AtomicBool::new(false),
            renewed_at: Mutex::new(None),
        }))
    }

    /// The current connection (a cheap handle).
    pub fn get(&self) -> redis::cluster_async::ClusterConnection {
        self.0.current.lock().unwrap().clone()
    }

    /// After `e`: when it says the connection has no node left, make a new one in the
    /// background (the caller's retry finds it).
    fn after(&self, e: &redis::RedisError) {
        use std::sync::atomic::Ordering;
        if e.kind() != redis::ErrorKind::ClusterConnectionNotFound {
            return;
        }
        let Some((nodes, timeout)) = self.0.remake.clone() else {
            return;
        };
        if self
            .0
            .renewed_at
            .lock()
            .unwrap()
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
            || self.0.renewing.swap(true, Ordering::SeqCst)
        {
            return;
        }
        let inner = self.0.clone();
        tokio::spawn(async move {
            let made = tokio::time::timeout(timeout, connect_cluster(&nodes, timeout)).await;
            match made {
                Ok(Ok(conn)) => {
                    *inner.current.lock().unwrap() = conn;
                    tracing::info!("replaced a Redis Cluster connection that had lost every node");
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "a new Redis Cluster connection failed too")
                }
                Err(_) => tracing::debug!("a new Redis Cluster connection did not answer in time"),
            }
            *inner.renewed_at.lock().unwrap() = Some(std::time::Instant::now());
            inner.renewing.store(false, Ordering::SeqCst);
        });
    }
}

/// A cluster connection through `nodes` (one attempt), which learns the cluster's nodes.
async fn connect_cluster(
    nodes: &ClusterNodes,
    timeout: Duration,
) -> RedisResult<redis::cluster_async::ClusterConnection> {
    let mut conn = nodes
        .client(redis::ProtocolVersion::RESP2)?
        .get_async_connection_with_config(
            ClusterConfig::new()
                .set_response_timeout(timeout)
                .set_connection_timeout(timeout.min(CLUSTER_CONNECT_TIMEOUT)),
        )
        .await?;
    nodes.learn(&mut conn).await;
    Ok(conn)
}

impl RedisTarget {
    /// Connect (one attempt; callers retry). `timeout` bounds each response.
    pub async fn connect(&self, timeout: Duration) -> RedisResult<RedisConn> {
        match self {
            RedisTarget::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_secs(2));
                ConnectionManager::new_with_config(client.clone(), config)
                    .await
                    .map(RedisConn::Single)
            }
            RedisTarget::Cluster(nodes) => {
                let conn = connect_cluster(nodes, timeout).await?;
                Ok(RedisConn::Cluster(SharedCluster::new(
                    conn,
                    Some((nodes.clone(), timeout)),
                )))
            }
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisTarget::Cluster(_))
    }

    /// A cluster connection subscribed to the sharded channel `channel` (`SSUBSCRIBE`),
    /// whose messages, subscription confirmations and disconnections arrive on `pushes`.
    /// redis-rs subscribes again wherever the channel's slot moves (failover, resharding)
    /// once it notices, and confirms each time. `None` for a single server.
    pub async fn subscribe_sharded(
        &self,
        channel: &str,
        pushes: tokio::sync::mpsc::UnboundedSender<redis::PushInfo>,
        timeout: Duration,
    ) -> Option<RedisResult<redis::cluster_async::ClusterConnection>> {
        let RedisTarget::Cluster(nodes) = self else {
            return None;
        };
        let connected = async {
            let mut conn = nodes
                .client(redis::ProtocolVersion::RESP3)?
                .get_async_connection_with_config(
                    ClusterConfig::new()
                        .set_response_timeout(timeout)
                        .set_connection_timeout(timeout.min(CLUSTER_CONNECT_TIMEOUT))
                        .set_push_sender(pushes),
                )
                .await?;
            conn.ssubscribe(channel).await?;
            Ok(conn)
        };
        Some(connected.await)
    }
}

impl RedisConn {
    /// `cmd` (a write of `key`) and then `WAIT replicas timeout`, as one pipeline on the
    /// connection to `key`'s master: `WAIT` counts only the writes of the connection it
    /// arrives on. The command's reply, and how many replicas acknowledged.
    pub async fn then_wait(
        &mut self,
        cmd: Cmd,
        key: &str,
        replicas: u32,
        timeout: Duration,
    ) -> RedisResult<(Value, u32)> {
        let mut pipe = redis::pipe();
        pipe.add_command(cmd)
            .cmd("WAIT")
            .arg(replicas)
            .arg(timeout.as_millis() as u64);
        // Replies as values, each error extracted below: a pipeline's own error would carry
        // no code (the publish function's verdicts, OOM), and the caller acts on the code.
        let mut replies: Vec<Value> = match self {
            RedisConn::Single(conn) => conn.req_packed_commands(&pipe, 0, 2).await?,
            RedisConn::Cluster(shared) => {
                let route = redis::cluster_routing::Route::with_slot(
                    Slot::for_key(key.as_bytes()),
                    SlotAddr::Master,
                );
                shared
                    .get()
                    .route_pipeline(pipe, 0, 2, SingleNodeRoutingInfo::SpecificNode(route))
                    .await
                    .inspect_err(|e| shared.after(e))?
            }
        };
        if replies.len() != 2 {
            return Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "script and WAIT pipeline",
                format!("{} replies", replies.len()),
            )));
        }
        let acked = replies.pop().expect("two replies").extract_error()?;
        let reply = replies.pop().expect("two replies").extract_error()?;
        Ok((reply, redis::from_redis_value::<u32>(acked)?))
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(shared) => {
                let shared = shared.clone();
                Box::pin(async move {
                    let mut conn = shared.get();
                    conn.req_packed_command(cmd)
                        .await
                        .inspect_err(|e| shared.after(e))
                })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(shared) => {
                let shared = shared.clone();
                Box::pin(async move {
                    let mut conn = shared.get();
                    conn.req_packed_commands(pipeline, offset, count)
                        .await
                        .inspect_err(|e| shared.after(e))
                })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(shared) => shared.get().get_db(),
        }
    }
}

/// A target for `url`: a cluster client when `cluster` (the URL names any node, or several
/// comma-separated, so that a process starting while one node is down finds the others),
/// otherwise [`client`]'s single-server client. `timeout` bounds the cluster client's
/// responses (each connection can set its own).
pub fn target(
    url: &str,
    cluster: bool,
    password_file: Option<&Path>,
    ca_file: Option<&Path>,
    flag: &str,
    timeout: Duration,
) -> Result<RedisTarget, ConfigError> {
    if !cluster {
        return Ok(RedisTarget::Single(client(
            url,
            password_file,
            ca_file,
            flag,
        )?));
    }
    let mut nodes = Vec::new();
    for node in url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let info = client(node, password_file, ca_file, flag)?
            .get_connection_info()
            .clone();
        if matches!(info.addr(), redis::ConnectionAddr::Unix(_)) {
            return Err(ConfigError(format!(
                "{flag}: a Redis Cluster is reached over TCP (redis:// or rediss://), not a Unix socket"
            )));
        }
        nodes.push(info);
    }
    if nodes.is_empty() {
        return Err(ConfigError(format!("{flag} names no Redis node")));
    }
    let root_cert = match ca_file {
        Some(path) => Some(
            std::fs::read(path)
                .map_err(|e| ConfigError(format!("CA file {}: {e}", path.display())))?,
        ),
        None => None,
    };
    // Built once here only to refuse a bad configuration at start.
    build_cluster_client(
        nodes.clone(),
        timeout,
        root_cert.as_ref(),
        redis::ProtocolVersion::RESP2,
    )
    .map_err(|e| {
        ConfigError(format!(
            "{flag}: {}",
            e.detail().unwrap_or("invalid cluster client configuration")
        ))
    })?;
    Ok(RedisTarget::Cluster(Arc::new(ClusterNodes {
        seeds: nodes.clone(),
        known: Mutex::new(nodes),
        timeout,
        root_cert,
        flag: flag.to_string(),
    })))
}

/// Build a client; `flag` names the URL's flag in error messages (which never show it).
pub fn client(
    url: &str,
    password_file: Option<&Path>,
    ca_file: Option<&Path>,
    flag: &str,
) -> Result<redis::Client, ConfigError> {
    let mut info = url.into_connection_info().map_err(|_| {
        ConfigError(format!(
            "{flag} is not a valid Redis URL (redis://[user:password@]host[:port][/db], rediss://... for TLS, or redis+unix:///path)"
        ))
    })?;
    if let redis::ConnectionAddr::Tcp(host, _) = info.addr() {
        if !is_loopback(host) {
            // Allowed (some networks encrypt below us), but never silently.
            tracing::warn!(
                %host,
                flag,
                "Redis connection without TLS to a remote host: use rediss:// unless the network is already encrypted"
            );
        }
    }
    if let Some(path) = password_file {
        let password = read_secret_file(path)?;
        let settings = info.redis_settings().clone().set_password(password);
        info = info.set_redis_settings(settings);
    }
    info = info.set_tcp_settings(tcp_deadlines());
    match ca_file {
        None => redis::Client::open(info),
        Some(path) => {
            let root_cert = std::fs::read(path)
                .map_err(|e| ConfigError(format!("CA file {}: {e}", path.display())))?;
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root_cert),
                },
            )
        }
    }
    .map_err(|e| {
        ConfigError(format!(
            "{flag}: {}",
            e.detail().unwrap_or("invalid client configuration")
        ))
    })
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_recognised() {
        for host in ["localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]"] {
            assert!(is_loopback(host), "{host}");
        }
        for host in ["redis", "10.0.0.1", "example.com", "::2"] {
            assert!(!is_loopback(host), "{host}");
        }
    }
}
