//! The services of a stack: in-process ([`RunningService`]) or as real processes
//! ([`ServiceProcess`], for signals), with the stack's flags and a test's own.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use chat_services::{Service, Side};
use clap::Parser;
use testkit::ChildProcess;
use tokio_util::sync::CancellationToken;

use super::Stack;

impl Stack<'_> {
    /// The service's flags (`extra` appended).
    pub(crate) fn service_args(&self, side: Side, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--side".into(),
            side.as_str().into(),
            "--database-url".into(),
            self.db.url(side.as_str()),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--admin-addr".into(),
            "127.0.0.1:0".into(),
            "--consumer-name".into(),
            format!("{side}-test"),
            "--lease-ttl".into(),
            "3s".into(),
            "--stream-shards".into(),
            self.shards.to_string(),
        ];
        args.extend(self.redis_flags());
        // The older tests predate identities: anonymous unless a test configures tokens.
        if !extra.contains(&"--jwks-file") && !extra.contains(&"--jwks-url") {
            args.push("--allow-anonymous=true".into());
        }
        // A flag given again in `extra` replaces the default's value (clap takes each once).
        let mut rest = extra.iter();
        while let Some(flag) = rest.next() {
            match args.iter().position(|a| a == flag) {
                Some(i) if flag.starts_with("--") && i + 1 < args.len() => {
                    if let Some(value) = rest.next() {
                        args[i + 1] = value.to_string();
                    }
                }
                _ => args.push(flag.to_string()),
            }
        }
        args
    }

    /// Start a service in-process.
    pub(crate) async fn service(&self, side: Side, extra: &[&str]) -> RunningService {
        self.service_with(self.service_args(side, extra)).await
    }

    /// Start a service in-process with exactly these flags.
    pub(crate) async fn service_with(&self, args: Vec<String>) -> RunningService {
        let mut argv = vec!["chat-service".to_string()];
        argv.extend(args);
        let config = chat_services::Cli::try_parse_from(argv)
            .expect("service flags")
            .validate()
            .expect("valid");
        let shutdown = CancellationToken::new();
        let service = Service::bind(config, shutdown.clone()).await.expect("bind");
        let addr = service.local_addr();
        let admin = service.admin_addr().expect("admin listener");
        let mut status = service.consumer_status();
        let task = tokio::spawn(service.run());
        testkit::wait_until(Duration::from_secs(20), "inbox consumer active", || {
            let s = status.borrow_and_update().clone();
            async move {
                if s.role == chat_services::ConsumerRole::Active {
                    Ok(())
                } else {
                    Err(format!("{s:?}"))
                }
            }
        })
        .await;
        RunningService {
            addr,
            admin,
            shutdown,
            task: Some(task),
        }
    }

    /// Start a service binary as a process on a free port; waits until it is ready.
    pub(crate) async fn service_process(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
    ) -> ServiceProcess {
        self.service_process_under(side, name, extra, &[]).await
    }

    /// A service process that stands by (another instance holds the inbox lease): waits
    /// until it answers /readyz.
    pub(crate) async fn service_process_standby(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
    ) -> ServiceProcess {
        let process = self.spawn_service(side, name, extra, &[]);
        testkit::wait_until(Duration::from_secs(30), "service ready", || async {
            match testkit::http::get(process.admin, "/readyz").await {
                Ok((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
        process
    }

    /// Same, run through `wrapper` (a command that execs the rest, such as `prlimit`).
    pub(crate) async fn service_process_under(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
        wrapper: &[&str],
    ) -> ServiceProcess {
        let process = self.spawn_service(side, name, extra, wrapper);
        process.wait_consuming().await;
        process
    }

    /// Start a service process and return at once (it may die before it is ready).
    pub(crate) fn spawn_service(
        &self,
        side: Side,
        name: &str,
        extra: &[&str],
        wrapper: &[&str],
    ) -> ServiceProcess {
        let port = testkit::http::free_port();
        let listen = format!("127.0.0.1:{port}");
        let admin = format!("127.0.0.1:{}", testkit::http::free_port());
        // Each process its own consumer (lease holder) name unless `extra` names one.
        let named: Vec<&str> = ["--consumer-name", name]
            .into_iter()
            .chain(extra.iter().copied())
            .collect();
        let mut args = self.service_args(side, &named);
        let i = args.iter().position(|a| a == "127.0.0.1:0").unwrap();
        args[i] = listen.clone();
        let a = args.iter().position(|a| a == "--admin-addr").unwrap() + 1;
        args[a] = admin.clone();
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut cmd = Command::new(program);
                cmd.args(rest).arg(env!("CARGO_BIN_EXE_chat-service"));
                cmd
            }
            None => Command::new(env!("CARGO_BIN_EXE_chat-service")),
        };
        cmd.args(args).env("RUST_LOG", "info");
        let log = testkit::scratch_dir("service-log").join(format!("{name}.log"));
        let child = ChildProcess::spawn(name, cmd, &log).expect("spawn chat-service");
        ServiceProcess {
            child,
            addr: listen.parse().unwrap(),
            admin: admin.parse().unwrap(),
        }
    }
}

pub(crate) struct RunningService {
    pub addr: SocketAddr,
    /// /healthz, /readyz, /metrics.
    pub admin: SocketAddr,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RunningService {
    pub(crate) async fn stop(mut self) {
        self.shutdown.cancel();
        let _ = self.task.take().unwrap().await;
    }
}

impl Drop for RunningService {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub(crate) struct ServiceProcess {
    pub child: ChildProcess,
    pub addr: SocketAddr,
    /// /healthz, /readyz, /metrics.
    pub admin: SocketAddr,
}

impl ServiceProcess {
    /// Until /readyz says the inbox consumer is active.
    pub(crate) async fn wait_consuming(&self) {
        testkit::wait_until(Duration::from_secs(30), "service consuming", || async {
            match testkit::http::get(self.admin, "/readyz").await {
                Ok((200, body)) if body.contains("\"consumer\":\"active\"") => Ok(()),
                other => Err(format!("{other:?}; exited: {:?}", self.child.try_status())),
            }
        })
        .await
    }
}
