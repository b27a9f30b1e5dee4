//! The deployment files against the binaries they run (containers.rs runs the compose file
//! for real). Every reference the files make is checked:
//! - every `outbox/*` image is a target of the Dockerfile, and compose builds that target;
//! - every environment variable and flag given to a binary is one it accepts (read from the
//!   same clap definitions that print `--help`), except `$(NAME)` helpers Kubernetes expands;
//! - every probe and health check asks a route the running binary serves (asked for real),
//!   on the port the container listens on, with a program the image contains;
//! - every secret file a container reads is mounted into it from the Secret of its own
//!   component, every ConfigMap key exists, the termination grace outlasts the relay's
//!   shutdown grace;
//! - every Kubernetes container has requests and a memory limit, every workload a
//!   NetworkPolicy, every Deployment a PodDisruptionBudget and node anti-affinity, and the
//!   manifests pass the Kubernetes schemas offline;
//! - workers.yaml is consumers.yaml with the sides swapped;
//! - the build context leaves out every secret;
//! - docs/deployment.md's configuration reference is what the binaries' --help says.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::support::RunningService;
use clap::CommandFactory;
use repo_checks::{read, repo};
use testkit::shared_postgres;
use tokio_util::sync::CancellationToken;
use yaml_rust2::{Yaml, YamlLoader};

// ---------------------------------------------------------------------------------------
// The binaries: what they accept.

/// Flags (`--name`) and environment variables one command accepts.
#[derive(Debug, Default, Clone)]
struct Accepts {
    flags: BTreeSet<String>,
    envs: BTreeSet<String>,
}

fn accepts(cmd: &clap::Command, inherited: &Accepts) -> Accepts {
    let mut out = inherited.clone();
    for arg in cmd.get_arguments() {
        if let Some(long) = arg.get_long() {
            out.flags.insert(format!("--{long}"));
        }
        if let Some(env) = arg.get_env() {
            out.envs.insert(env.to_string_lossy().into_owned());
        }
    }
    out
}

/// Each binary's commands: "" for a binary without subcommands.
fn binaries() -> BTreeMap<&'static str, BTreeMap<String, Accepts>> {
    let mut all = BTreeMap::new();
    let relay = cdc_relay::cli::Cli::command();
    let globals = accepts(&relay, &Accepts::default());
    let subcommands = relay
        .get_subcommands()
        .map(|sub| (sub.get_name().to_string(), accepts(sub, &globals)))
        .collect();
    all.insert("cdc-relay", subcommands);
    for (name, cmd) in [
        ("chat-service", chat_services::Cli::command()),
        ("migrate", chat_services::MigrateCli::command()),
    ] {
        all.insert(
            name,
            BTreeMap::from([(String::new(), accepts(&cmd, &Accepts::default()))]),
        );
    }
    all.insert(
        "healthcheck",
        BTreeMap::from([(String::new(), Accepts::default())]),
    );
    all
}

/// What one container runs: binary, subcommand, and the env and flags it is given.
struct Invocation<'a> {
    binary: &'a str,
    subcommand: String,
    env: BTreeMap<String, String>,
    args: Vec<String>,
}

/// Check an invocation against what the binary accepts; returns the problems found.
fn check_invocation(
    place: &str,
    inv: &Invocation<'_>,
    bins: &BTreeMap<&str, BTreeMap<String, Accepts>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(commands) = bins.get(inv.binary) else {
        return vec![format!("{place}: runs unknown binary {}", inv.binary)];
    };
    let Some(accepted) = commands.get(&inv.subcommand) else {
        return vec![format!(
            "{place}: {} has no subcommand {:?}",
            inv.binary, inv.subcommand
        )];
    };
    // The relay's init container shares the relay's environment: a variable of `run` given
    // to `setup` is ignored by it, which is intended (one list for both).
    let also: BTreeSet<String> = if inv.binary == "cdc-relay" {
        commands
            .values()
            .flat_map(|a| a.envs.iter().cloned())
            .collect()
    } else {
        BTreeSet::new()
    };
    // `$(NAME)` helpers: referenced by another variable's value (Kubernetes expands them).
    let helpers: BTreeSet<String> = inv.env.values().flat_map(|v| dollar_refs(v)).collect();
    for name in inv.env.keys() {
        if !accepted.envs.contains(name) && !also.contains(name) && !helpers.contains(name) {
            problems.push(format!(
                "{place}: {} {} does not read the environment variable {name}",
                inv.binary, inv.subcommand
            ));
        }
    }
    for helper in &helpers {
        if !inv.env.contains_key(helper) {
            problems.push(format!("{place}: $({helper}) is not defined"));
        }
    }
    for arg in &inv.args {
        if let Some(flag) = arg.strip_prefix("--") {
            let name = format!("--{}", flag.split('=').next().unwrap());
            if !accepted.flags.contains(&name) {
                problems.push(format!("{place}: {} has no flag {name}", inv.binary));
            }
        }
    }
    problems
}

fn dollar_refs(value: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = value;
    while let Some(start) = rest.find("$(") {
        let after = &rest[start + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].to_string());
        rest = &after[end..];
    }
    out
}

// ---------------------------------------------------------------------------------------
// The running binaries: which routes they serve.

/// Routes the deployment files probe, and for each server whether it answers (not 404).
struct Routes {
    service: SocketAddr,
    service_admin: SocketAddr,
    relay_admin: SocketAddr,
}

/// One HTTP listener of a binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listener {
    Service,
    ServiceAdmin,
    RelayAdmin,
}

impl Routes {
    async fn answers(&self, binary: &str, listener: Listener, path: &str) -> Result<(), String> {
        let addr = match listener {
            Listener::Service => self.service,
            Listener::ServiceAdmin => self.service_admin,
            Listener::RelayAdmin => self.relay_admin,
        };
        let (status, body) = testkit::http::get(addr, path)
            .await
            .map_err(|e| format!("GET {path} on {binary}: {e}"))?;
        if status == 404 {
            return Err(format!("{binary} has no route {path}: {body}"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The Dockerfile.

#[derive(Debug, Clone, Default)]
struct Target {
    /// Programs in /usr/local/bin.
    programs: BTreeSet<String>,
    env: BTreeMap<String, String>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    healthcheck: Vec<String>,
}

fn json_array(text: &str) -> Vec<String> {
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("not a JSON array: {text}: {e}"))
}

fn dockerfile_targets() -> BTreeMap<String, Target> {
    let text = read("Dockerfile");
    let joined = text.replace("\\\n", " ");
    let mut targets: BTreeMap<String, Target> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in joined.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (instr, rest) = line.split_once(' ').unwrap_or((line, ""));
        match instr {
            "FROM" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                let base = targets.get(words[0]).cloned().unwrap_or_default();
                let name = words
                    .iter()
                    .position(|w| w.eq_ignore_ascii_case("AS"))
                    .map(|i| words[i + 1].to_string())
                    .expect("every stage is named");
                targets.insert(name.clone(), base);
                current = Some(name);
            }
            "COPY" => {
                let t = targets.get_mut(current.as_ref().unwrap()).unwrap();
                let words: Vec<&str> = rest.split_whitespace().collect();
                if words.last() == Some(&"/usr/local/bin/") {
                    for src in &words[..words.len() - 1] {
                        if !src.starts_with("--") {
                            t.programs
                                .insert(src.rsplit('/').next().unwrap().to_string());
                        }
                    }
                }
            }
            "ENV" => {
                let t = targets.get_mut(current.as_ref().unwrap()).unwrap();
                for pair in rest.split_whitespace() {
                    let (k, v) = pair.split_once('=').expect("ENV k=v");
                    t.env.insert(k.into(), v.into());
                }
            }
            "ENTRYPOINT" => {
                targets
                    .get_mut(current.as_ref().unwrap())
                    .unwrap()
                    .entrypoint = json_array(rest)
            }
            "CMD" => targets.get_mut(current.as_ref().unwrap()).unwrap().cmd = json_array(rest),
            "HEALTHCHECK" => {
                let cmd = rest.split_once("CMD").expect("HEALTHCHECK ... CMD [...]").1;
                targets
                    .get_mut(current.as_ref().unwrap())
                    .unwrap()
                    .healthcheck = json_array(cmd)
            }
            _ => {}
        }
    }
    targets
}

/// The binary an image target runs.
fn entry_binary(target: &Target) -> String {
    let path = target.entrypoint.first().expect("an ENTRYPOINT");
    let name = path.rsplit('/').next().unwrap().to_string();
    assert!(
        target.programs.contains(&name),
        "ENTRYPOINT {path} is not copied into the image"
    );
    name
}

/// The subcommand (the relay's first argument) and the flags a container gives its binary:
/// `given` (compose `command`, Kubernetes `args`), or the image's CMD when absent.
fn command_line(binary: &str, target: &Target, given: &Yaml) -> (String, Vec<String>) {
    let command = if given.is_badvalue() {
        target.cmd.clone()
    } else {
        strings(given)
    };
    if binary == "cdc-relay" {
        (command[0].clone(), command[1..].to_vec())
    } else {
        (String::new(), command)
    }
}

/// The ports a container listens on, from its listen variables (the image defaults if unset).
fn listen_ports(binary: &str, env: &BTreeMap<String, String>) -> Vec<(u16, Listener)> {
    let vars: &[(&str, Listener)] = match binary {
        "chat-service" => &[
            ("LISTEN_ADDR", Listener::Service),
            ("CHAT_ADMIN_ADDR", Listener::ServiceAdmin),
        ],
        "cdc-relay" => &[("CDC_ADMIN_ADDR", Listener::RelayAdmin)],
        _ => &[],
    };
    vars.iter()
        .filter_map(|(var, listener)| {
            let port = env.get(*var)?.rsplit(':').next()?.parse().ok()?;
            Some((port, *listener))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// YAML helpers.

fn load_yaml(path: &str) -> Vec<Yaml> {
    YamlLoader::load_from_str(&read(path)).unwrap_or_else(|e| panic!("{path} does not parse: {e}"))
}

/// Apply YAML merge keys (`<<: *anchor`), which compose uses and the loader leaves as keys.
fn merged(node: &Yaml) -> Yaml {
    match node {
        Yaml::Hash(map) => {
            let mut out = yaml_rust2::yaml::Hash::new();
            let merge_key = Yaml::String("<<".into());
            for (k, v) in map {
                if *k != merge_key {
                    out.insert(k.clone(), merged(v));
                }
            }
            if let Some(sources) = map.get(&merge_key) {
                let sources = match sources {
                    Yaml::Array(list) => list.clone(),
                    one => vec![one.clone()],
                };
                for source in sources {
                    if let Yaml::Hash(src) = merged(&source) {
                        for (k, v) in src {
                            out.entry(k).or_insert(v);
                        }
                    }
                }
            }
            Yaml::Hash(out)
        }
        Yaml::Array(list) => Yaml::Array(list.iter().map(merged).collect()),
        other => other.clone(),
    }
}

fn string(node: &Yaml) -> String {
    match node {
        Yaml::String(s) | Yaml::Real(s) => s.clone(),
        Yaml::Integer(i) => i.to_string(),
        Yaml::Boolean(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

fn strings(node: &Yaml) -> Vec<String> {
    node.as_vec()
        .map(|v| v.iter().map(string).collect())
        .unwrap_or_default()
}

fn hash_keys(node: &Yaml) -> Vec<String> {
    node.as_hash()
        .map(|h| h.keys().map(string).collect())
        .unwrap_or_default()
}

/// `[localhost/]outbox/<target>[:tag]` → target.
fn outbox_target(image: &str) -> Option<String> {
    let rest = image
        .strip_prefix("localhost/outbox/")
        .or_else(|| image.strip_prefix("outbox/"))?;
    Some(rest.split(':').next().unwrap().to_string())
}

/// An image as written, or its default when written `${VARIABLE:-default}`.
fn image_default(image: &str) -> &str {
    image
        .strip_prefix("${")
        .and_then(|rest| rest.strip_suffix('}'))
        .and_then(|rest| rest.split_once(":-"))
        .map_or(image, |(_, default)| default)
}

/// Upstream images the files may use (Postgres and Redis of the supported versions; Redis
/// 7.2 or later, 7.0 being out of support).
const UPSTREAM_IMAGES: &[&str] = &["postgres:15-bookworm", "redis:7.2-bookworm"];

// ---------------------------------------------------------------------------------------

/// A chat service and a relay admin server, running, to ask for the routes the files probe.
async fn running_servers() -> (Routes, RunningService, CancellationToken) {
    let service = RunningService::start(shared_postgres()).await;
    // A relay whose database is unreachable still serves its admin routes.
    let argv = [
        "cdc-relay",
        "run",
        "--database-url",
        "postgres://nobody@%2Fnonexistent/none",
        "--slot",
        "s",
        "--publication",
        "p",
        "--outbox-table",
        "a.b",
        "--redis-url",
        "redis+unix:///nonexistent.sock",
        "--stream",
        "s",
        "--admin-addr",
        "127.0.0.1:0",
    ];
    let cdc_relay::cli::Command::Run(args) =
        <cdc_relay::cli::Cli as clap::Parser>::try_parse_from(argv)
            .unwrap()
            .command
    else {
        unreachable!()
    };
    let relay = cdc_relay::Relay::new(args.validate().unwrap());
    let stop = CancellationToken::new();
    {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { relay.run(stop).await });
    }
    let relay_admin = testkit::wait_until(Duration::from_secs(10), "relay admin bound", || {
        let addr = relay.admin_addr();
        async move { addr.ok_or_else(|| "not yet".to_string()) }
    })
    .await;
    let routes = Routes {
        service: service.addr,
        service_admin: service.admin,
        relay_admin,
    };
    (routes, service, stop)
}

#[tokio::test]
async fn compose_references_only_what_exists() {
    let (routes, _service, _relay) = running_servers().await;
    let bins = binaries();
    let targets = dockerfile_targets();
    let doc = merged(&load_yaml("deploy/compose.yaml")[0]);
    let services = doc["services"].as_hash().expect("services");
    let declared_secrets: BTreeSet<String> = hash_keys(&doc["secrets"]).into_iter().collect();
    let mut problems = Vec::new();

    for (name, svc) in services {
        let name = string(name);
        let place = format!("compose service {name}");
        let image = string(&svc["image"]);
        let Some(target_name) = outbox_target(&image) else {
            if !UPSTREAM_IMAGES.contains(&image_default(&image)) {
                problems.push(format!(
                    "{place}: image {image} is not ours nor a supported upstream image"
                ));
            }
            for volume in strings(&svc["volumes"]) {
                let source = volume.split(':').next().unwrap();
                if source.starts_with("./") && !repo().join("deploy").join(source).exists() {
                    problems.push(format!("{place}: mounts {source}, which does not exist"));
                }
            }
            continue;
        };
        let Some(target) = targets.get(&target_name) else {
            problems.push(format!("{place}: image {image} is not a Dockerfile target"));
            continue;
        };
        if string(&svc["build"]["target"]) != target_name {
            problems.push(format!(
                "{place}: builds target {:?} for image {image}",
                svc["build"]["target"]
            ));
        }
        let binary = entry_binary(target);
        let (subcommand, args) = command_line(&binary, target, &svc["command"]);
        let mut env: BTreeMap<String, String> = svc["environment"]
            .as_hash()
            .map(|h| h.iter().map(|(k, v)| (string(k), string(v))).collect())
            .unwrap_or_default();
        let inv = Invocation {
            binary: &binary,
            subcommand,
            env: env.clone(),
            args: args.clone(),
        };
        problems.extend(check_invocation(&place, &inv, &bins));

        // Secret files read must be mounted.
        let mounted: BTreeSet<String> = strings(&svc["secrets"]).into_iter().collect();
        for secret in &mounted {
            if !declared_secrets.contains(secret) {
                problems.push(format!("{place}: secret {secret} is not declared"));
            }
        }
        for value in env.values().chain(args.iter()) {
            for (i, _) in value.match_indices("/run/secrets/") {
                let file: String = value[i + "/run/secrets/".len()..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'))
                    .collect();
                if !mounted.contains(&file) {
                    problems.push(format!(
                        "{place}: reads /run/secrets/{file}, which is not mounted"
                    ));
                }
            }
        }

        // Health check: our probe, in the image, on the port this container listens on.
        for (k, v) in &target.env {
            env.entry(k.clone()).or_insert(v.clone());
        }
        let test = strings(&svc["healthcheck"]["test"]);
        if !test.is_empty() {
            let ports = listen_ports(&binary, &env);
            match test.as_slice() {
                [cmd, program, url] if cmd == "CMD" => {
                    let program = program.rsplit('/').next().unwrap();
                    if !target.programs.contains(program) {
                        problems.push(format!(
                            "{place}: health check runs {program}, not in the image"
                        ));
                    }
                    problems.extend(check_url(&place, url, &binary, &ports, &routes).await);
                }
                other => problems.push(format!(
                    "{place}: health check {other:?} is not `CMD healthcheck URL`"
                )),
            }
        }

        // A sidecar shares its service's network: its admin port is published there.
        let network = string_or_empty(&svc["network_mode"]);
        if let Some(owner) = network.strip_prefix("service:") {
            let owner_ports = strings(&doc["services"][owner]["ports"]);
            let port = listen_ports(&binary, &env)
                .first()
                .expect("relay listens")
                .0;
            if !owner_ports.iter().any(|p| p.ends_with(&format!(":{port}"))) {
                problems.push(format!(
                    "{place}: admin port {port} is not published by {owner}"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "deploy/compose.yaml:\n{}",
        problems.join("\n")
    );
}

fn string_or_empty(node: &Yaml) -> String {
    if node.is_badvalue() || node.is_null() {
        String::new()
    } else {
        string(node)
    }
}

/// `http://127.0.0.1:PORT/PATH` must be a route of `binary` on the port it listens on.
async fn check_url(
    place: &str,
    url: &str,
    binary: &str,
    ports: &[(u16, Listener)],
    routes: &Routes,
) -> Vec<String> {
    let Some(rest) = url.strip_prefix("http://127.0.0.1:") else {
        return vec![format!("{place}: probe URL {url} is not on loopback")];
    };
    let (p, path) = rest.split_once('/').unwrap();
    let Some((_, listener)) = ports
        .iter()
        .find(|(n, _)| Some(*n) == p.parse::<u16>().ok())
    else {
        return vec![format!(
            "{place}: probes port {p}, but {binary} listens on {:?}",
            ports.iter().map(|(n, _)| n).collect::<Vec<_>>()
        )];
    };
    match routes.answers(binary, *listener, &format!("/{path}")).await {
        Ok(()) => Vec::new(),
        Err(e) => vec![format!("{place}: {e}")],
    }
}

/// Every workload of deploy/k8s, as (file, document).
fn k8s_documents() -> Vec<(String, Yaml)> {
    let kustomization = &load_yaml("deploy/k8s/kustomization.yaml")[0];
    strings(&kustomization["resources"])
        .into_iter()
        .flat_map(|file| {
            let path = format!("deploy/k8s/{file}");
            load_yaml(&path).into_iter().map(move |d| (path.clone(), d))
        })
        .collect()
}

#[tokio::test]
async fn kubernetes_manifests_reference_only_what_exists() {
    let (routes, _service, _relay) = running_servers().await;
    let bins = binaries();
    let targets = dockerfile_targets();
    let kustomization = &load_yaml("deploy/k8s/kustomization.yaml")[0];
    // Generated Secret name → its keys.
    let secrets: BTreeMap<String, BTreeSet<String>> = kustomization["secretGenerator"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|generator| {
            let keys = generator["files"]
                .as_vec()
                .unwrap()
                .iter()
                .map(|f| string(f).split('=').next().unwrap().to_string())
                .collect();
            (string(&generator["name"]), keys)
        })
        .collect();
    let documents = k8s_documents();
    let config_keys: BTreeSet<String> = documents
        .iter()
        .find(|(_, d)| string_or_empty(&d["kind"]) == "ConfigMap")
        .map(|(_, d)| hash_keys(&d["data"]).into_iter().collect())
        .expect("a ConfigMap");
    let config = documents
        .iter()
        .find(|(_, d)| string_or_empty(&d["kind"]) == "ConfigMap")
        .map(|(_, d)| d["data"].clone())
        .unwrap();
    let mut problems = Vec::new();
    let mut named_ports = BTreeSet::new();

    for (file, doc) in &documents {
        let kind = string_or_empty(&doc["kind"]);
        let pod = match kind.as_str() {
            "Deployment" | "Job" => &doc["spec"]["template"]["spec"],
            _ => continue,
        };
        let volumes: BTreeMap<String, &Yaml> = pod["volumes"]
            .as_vec()
            .map(|v| v.iter().map(|vol| (string(&vol["name"]), vol)).collect())
            .unwrap_or_default();
        for vol in volumes.values() {
            if let Some(items) = vol["secret"]["items"].as_vec() {
                let name = string(&vol["secret"]["secretName"]);
                let Some(keys) = secrets.get(&name) else {
                    problems.push(format!(
                        "{file}: secret {name} is not generated by kustomization.yaml"
                    ));
                    continue;
                };
                for item in items {
                    let key = string(&item["key"]);
                    if !keys.contains(&key) {
                        problems.push(format!("{file}: secret {name} has no key {key}"));
                    }
                }
            }
        }
        // Only the migration Job's Secret holds the superuser's password.
        let labels = &doc["spec"]["template"]["metadata"]["labels"];
        for vol in volumes.values() {
            let name = string_or_empty(&vol["secret"]["secretName"]);
            if secrets
                .get(&name)
                .is_some_and(|k| k.contains("pg-postgres"))
                && kind != "Job"
            {
                problems.push(format!(
                    "{file}: mounts {name}, which holds the superuser's password"
                ));
            }
        }
        // A NetworkPolicy for ingress and egress selects these pods; a Deployment also has a
        // PodDisruptionBudget and spreads its pods over nodes.
        let selects = |other: &Yaml| {
            other["matchLabels"].as_hash().is_some_and(|want| {
                want.iter()
                    .all(|(k, v)| labels[string(k).as_str()].as_str() == v.as_str())
            })
        };
        let policy = documents.iter().find(|(_, d)| {
            string_or_empty(&d["kind"]) == "NetworkPolicy" && selects(&d["spec"]["podSelector"])
        });
        match policy {
            Some((_, p)) => {
                let types: BTreeSet<String> =
                    strings(&p["spec"]["policyTypes"]).into_iter().collect();
                if types != BTreeSet::from(["Ingress".to_string(), "Egress".to_string()]) {
                    problems.push(format!(
                        "{file}: its NetworkPolicy must restrict both Ingress and Egress"
                    ));
                }
                // Egress to the servers on the ports config.yaml gives them.
                let egress_ports: BTreeSet<String> = p["spec"]["egress"]
                    .as_vec()
                    .into_iter()
                    .flatten()
                    .flat_map(|rule| rule["ports"].as_vec().into_iter().flatten())
                    .map(|port| match &port["port"] {
                        Yaml::Integer(n) => n.to_string(),
                        other => string_or_empty(other),
                    })
                    .collect();
                let needed: &[&str] = if kind == "Job" {
                    &["PG_PORT"]
                } else {
                    &["PG_PORT", "REDIS_PORT"]
                };
                for key in needed {
                    let port = string_or_empty(&config[*key]);
                    if !egress_ports.contains(&port) {
                        problems.push(format!(
                            "{file}: its NetworkPolicy does not let it reach {key} {port} (config.yaml)"
                        ));
                    }
                }
            }
            None => problems.push(format!("{file}: no NetworkPolicy selects its pods")),
        }
        if kind == "Deployment" {
            let budget = documents.iter().any(|(_, d)| {
                string_or_empty(&d["kind"]) == "PodDisruptionBudget"
                    && selects(&d["spec"]["selector"])
                    && d["spec"]["minAvailable"].as_i64() == Some(1)
            });
            if !budget {
                problems.push(format!(
                    "{file}: no PodDisruptionBudget keeps one of its pods (minAvailable: 1)"
                ));
            }
            let spread = &pod["affinity"]["podAntiAffinity"]
                ["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"];
            if string_or_empty(&spread["topologyKey"]) != "kubernetes.io/hostname"
                || !selects(&spread["labelSelector"])
            {
                problems.push(format!(
                    "{file}: its pods do not prefer different nodes (podAntiAffinity on kubernetes.io/hostname)"
                ));
            }
        }
        let containers = pod["initContainers"]
            .as_vec()
            .into_iter()
            .flatten()
            .chain(pod["containers"].as_vec().into_iter().flatten());
        let workload = string(&doc["metadata"]["name"]);
        for c in containers {
            let cname = string(&c["name"]);
            let place = format!("{file} container {cname}");
            // Each component reads its own Secret, as files: the service (and the schema
            // wait, which runs as the service's role) `<side>-credentials`, the relay
            // `<side>-relay-credentials`, the Job `chat-migrate-credentials`.
            let own = match (kind.as_str(), cname.as_str()) {
                ("Job", _) => format!("{workload}-credentials"),
                (_, "cdc-relay" | "relay-setup") => format!("{workload}-relay-credentials"),
                _ => format!("{workload}-credentials"),
            };
            for mount in c["volumeMounts"].as_vec().into_iter().flatten() {
                let volume = string(&mount["name"]);
                let secret = volumes
                    .get(&volume)
                    .map(|v| string_or_empty(&v["secret"]["secretName"]))
                    .unwrap_or_default();
                if !secret.is_empty() && secret != own {
                    problems.push(format!(
                        "{place}: mounts the Secret {secret}; its own is {own}"
                    ));
                }
            }
            let env_secret = c["envFrom"].as_vec().is_some_and(|v| !v.is_empty())
                || c["env"]
                    .as_vec()
                    .into_iter()
                    .flatten()
                    .any(|var| !var["valueFrom"]["secretKeyRef"].is_badvalue());
            if env_secret {
                problems.push(format!(
                    "{place}: takes a Secret through its environment; credentials are mounted files"
                ));
            }
            let resources = &c["resources"];
            if resources["requests"]["cpu"].is_badvalue()
                || resources["requests"]["memory"].is_badvalue()
                || resources["limits"]["memory"].is_badvalue()
            {
                problems.push(format!(
                    "{place}: needs requests (cpu, memory) and a memory limit"
                ));
            }
            let image = string(&c["image"]);
            let Some(target) = outbox_target(&image).and_then(|t| targets.get(&t).cloned()) else {
                problems.push(format!("{place}: image {image} is not a Dockerfile target"));
                continue;
            };
            let binary = entry_binary(&target);
            let (subcommand, args) = command_line(&binary, &target, &c["args"]);
            let mut env = BTreeMap::new();
            for var in c["env"].as_vec().into_iter().flatten() {
                let name = string(&var["name"]);
                let cm = &var["valueFrom"]["configMapKeyRef"];
                if !cm.is_badvalue() {
                    let key = string(&cm["key"]);
                    if !config_keys.contains(&key) {
                        problems.push(format!("{place}: ConfigMap key {key} does not exist"));
                    }
                }
                // Helpers must be defined before use (Kubernetes expands only earlier ones).
                let value = string_or_empty(&var["value"]);
                for r in dollar_refs(&value) {
                    if !env.contains_key(&r) {
                        problems.push(format!("{place}: {name} uses $({r}) before it is defined"));
                    }
                }
                env.insert(name, value);
            }
            let is_run = subcommand == "run";
            let inv = Invocation {
                binary: &binary,
                subcommand,
                env: env.clone(),
                args: args.clone(),
            };
            problems.extend(check_invocation(&place, &inv, &bins));

            // Files read from mounted volumes exist in them.
            let mounts: Vec<(String, String)> = c["volumeMounts"]
                .as_vec()
                .into_iter()
                .flatten()
                .map(|m| (string(&m["mountPath"]), string(&m["name"])))
                .collect();
            for (_, volume) in &mounts {
                if !volumes.contains_key(volume) {
                    problems.push(format!("{place}: mounts undefined volume {volume}"));
                }
            }
            for value in env.values().chain(args.iter()) {
                let path = value.rsplit('=').next().unwrap();
                if !path.starts_with("/run/secrets/") {
                    continue;
                }
                let found = mounts.iter().any(|(mount, volume)| {
                    path.strip_prefix(&format!("{mount}/")).is_some_and(|item| {
                        volumes
                            .get(volume)
                            .and_then(|v| v["secret"]["items"].as_vec())
                            .is_some_and(|items| items.iter().any(|i| string(&i["path"]) == item))
                    })
                });
                if !found {
                    problems.push(format!(
                        "{place}: reads {path}, which no mounted volume provides"
                    ));
                }
            }

            // Probes: a route of this binary on a declared port it listens on.
            for (k, v) in &target.env {
                env.entry(k.clone()).or_insert(v.clone());
            }
            let ports: BTreeMap<String, u16> = c["ports"]
                .as_vec()
                .into_iter()
                .flatten()
                .map(|p| {
                    (
                        string(&p["name"]),
                        p["containerPort"].as_i64().unwrap() as u16,
                    )
                })
                .collect();
            let listening = listen_ports(&binary, &env);
            for (port_name, number) in &ports {
                named_ports.insert(port_name.clone());
                if !listening.iter().any(|(n, _)| n == number) {
                    problems.push(format!(
                        "{place}: port {port_name} is {number}, but {binary} listens on {:?}",
                        listening.iter().map(|(n, _)| n).collect::<Vec<_>>()
                    ));
                }
            }
            for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                let get = &c[probe]["httpGet"];
                if get.is_badvalue() {
                    continue;
                }
                let port = string(&get["port"]);
                let Some(number) = ports.get(&port) else {
                    problems.push(format!("{place}: {probe} uses undeclared port {port}"));
                    continue;
                };
                let url = format!("http://127.0.0.1:{number}{}", string(&get["path"]));
                problems.extend(
                    check_url(
                        &format!("{place} {probe}"),
                        &url,
                        &binary,
                        &listening,
                        &routes,
                    )
                    .await,
                );
            }

            // The kubelet must not SIGKILL the relay before its final acknowledgement.
            if binary == "cdc-relay" && is_run {
                let grace = pod["terminationGracePeriodSeconds"].as_i64().unwrap_or(30);
                let shutdown = env
                    .get("CDC_SHUTDOWN_GRACE")
                    .map(|v| humantime::parse_duration(v).unwrap().as_secs() as i64)
                    .unwrap_or(1);
                let pre_stop = pod["containers"]
                    .as_vec()
                    .unwrap()
                    .iter()
                    .filter_map(|c| c["lifecycle"]["preStop"]["sleep"]["seconds"].as_i64())
                    .max()
                    .unwrap_or(0);
                if grace < shutdown + pre_stop + 5 {
                    problems.push(format!("{place}: terminationGracePeriodSeconds {grace} is too short for a {shutdown} s shutdown grace after a {pre_stop} s preStop"));
                }
            }
        }
        if kind == "Deployment" {
            let rolling = &doc["spec"]["strategy"]["rollingUpdate"];
            if rolling["maxUnavailable"].as_i64() != Some(0) {
                problems.push(format!("{file}: a rolling update must keep every old pod until its replacement is ready (maxUnavailable: 0)"));
            }
        }
    }
    for (file, doc) in &documents {
        if string_or_empty(&doc["kind"]) == "PodMonitor" {
            for endpoint in doc["spec"]["podMetricsEndpoints"].as_vec().unwrap() {
                let port = string(&endpoint["port"]);
                if !named_ports.contains(&port) {
                    problems.push(format!(
                        "{file}: scrapes port {port}, which no container declares"
                    ));
                }
                let (binary, listener) = match port.as_str() {
                    "http" => ("chat-service", Listener::Service),
                    "admin" => ("chat-service", Listener::ServiceAdmin),
                    _ => ("cdc-relay", Listener::RelayAdmin),
                };
                if let Err(e) = routes
                    .answers(binary, listener, &string(&endpoint["path"]))
                    .await
                {
                    problems.push(format!("{file}: {e}"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "deploy/k8s:\n{}", problems.join("\n"));
}

#[test]
fn the_workers_manifest_is_the_consumers_manifest_with_sides_swapped() {
    let consumers = read("deploy/k8s/consumers.yaml");
    let swapped = consumers
        .replace("consumers", "\u{0}")
        .replace("workers", "consumers")
        .replace('\u{0}', "workers")
        .replace("Consumers", "Workers");
    assert!(
        swapped == read("deploy/k8s/workers.yaml"),
        "deploy/k8s/workers.yaml drifted from consumers.yaml; regenerate it by swapping the sides"
    );
}

// ---------------------------------------------------------------------------------------
// The configuration reference in docs/deployment.md.

const BEGIN: &str =
    "<!-- config-reference:begin (generated by repo-checks/tests/deployment.rs) -->";
const END: &str = "<!-- config-reference:end -->";

fn reference_table(title: &str, cmd: &clap::Command, globals: &[&clap::Arg]) -> String {
    let mut out = format!("#### `{title}`\n\n");
    let about = cmd.get_about().map(|a| a.to_string()).unwrap_or_default();
    if !about.is_empty() {
        out.push_str(&format!("{about}.\n\n"));
    }
    out.push_str("| Flag | Environment | Default | Meaning |\n|---|---|---|---|\n");
    let args = cmd
        .get_arguments()
        .chain(globals.iter().copied())
        // Hidden flags are fault-injection hooks for the lab, not configuration.
        .filter(|a| !a.is_hide_set())
        .filter(|a| a.get_long().is_some() && !matches!(a.get_long(), Some("help" | "version")));
    for arg in args {
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_else(|| "".into());
        let default: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|d| d.to_string_lossy().into_owned())
            .collect();
        let default = match default.as_slice() {
            [] => String::new(),
            [one] if one.is_empty() => "(empty)".into(),
            many => format!("`{}`", many.join(",")),
        };
        let mut meaning = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let values: Vec<String> = if arg.get_action().takes_values() {
            arg.get_possible_values()
                .iter()
                .map(|v| format!("`{}`", v.get_name()))
                .collect()
        } else {
            Vec::new()
        };
        if !values.is_empty() {
            meaning = format!(
                "{}. One of {}.",
                meaning.trim_end_matches('.'),
                values.join(", ")
            );
        }
        if arg.is_required_set() {
            meaning = format!("**Required.** {meaning}");
        }
        out.push_str(&format!(
            "| `--{}` | {env} | {default} | {} |\n",
            arg.get_long().unwrap(),
            meaning.replace('|', "\\|")
        ));
    }
    out
}

fn configuration_reference() -> String {
    let mut out = String::new();
    let relay = cdc_relay::cli::Cli::command();
    let globals: Vec<&clap::Arg> = relay
        .get_arguments()
        .filter(|a| !matches!(a.get_long(), Some("help" | "version")))
        .collect();
    for sub in relay.get_subcommands() {
        out.push_str(&reference_table(
            &format!("cdc-relay {}", sub.get_name()),
            sub,
            &globals,
        ));
        out.push('\n');
    }
    out.push_str(&reference_table(
        "chat-service",
        &chat_services::Cli::command(),
        &[],
    ));
    out.push('\n');
    out.push_str(&reference_table(
        "migrate",
        &chat_services::MigrateCli::command(),
        &[],
    ));
    out.push_str(
        "\n#### `healthcheck`\n\n`healthcheck [--verbose] http://127.0.0.1:PORT/PATH` exits 0 when the URL \
         answers 2xx within 2 s, 1 otherwise (the images have no shell or curl); `--verbose` prints \
         the status and the body (`/readyz`: `reason`, `last_error`).\n",
    );
    out
}

#[test]
fn the_configuration_reference_matches_the_binaries() {
    let path = repo().join("docs/deployment.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let start = doc.find(BEGIN).expect("the reference's begin marker") + BEGIN.len();
    let end = doc.find(END).expect("the reference's end marker");
    let expected = format!("\n{}\n", configuration_reference());
    if doc[start..end] != expected {
        if std::env::var_os("UPDATE_DOCS").is_some() {
            let updated = format!("{}{}{}", &doc[..start], expected, &doc[end..]);
            std::fs::write(&path, updated).unwrap();
        } else {
            panic!(
                "docs/deployment.md's configuration reference is out of date; regenerate it with\n  \
                 UPDATE_DOCS=1 cargo test -p repo-checks deployment::the_configuration_reference"
            );
        }
    }
}

/// The binaries' actual --help names every variable the reference names.
#[test]
fn help_output_lists_every_environment_variable() {
    for (bin, cmd) in [
        (
            repo_checks::binary("chat-service"),
            chat_services::Cli::command(),
        ),
        (
            repo_checks::binary("migrate"),
            chat_services::MigrateCli::command(),
        ),
    ] {
        let out = std::process::Command::new(&bin)
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            if let Some(env) = arg.get_env() {
                let env = env.to_string_lossy();
                assert!(
                    help.contains(&format!("env: {env}")),
                    "{} --help does not show {env}",
                    bin.display()
                );
            }
        }
    }
}

/// The directories `make-secrets.sh DIR` is run on in the docs and the deploy files.
fn secret_directories() -> BTreeSet<String> {
    let mut dirs = BTreeSet::new();
    for path in [
        "README.md",
        "docs/deployment.md",
        "docs/operations.md",
        "deploy/compose.yaml",
    ]
    .into_iter()
    .chain(["deploy/k8s/kustomization.yaml", "deploy/local.sh"])
    {
        let text = read(path);
        for (i, _) in text.match_indices("make-secrets.sh ") {
            let arg: String = text[i + "make-secrets.sh ".len()..]
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '`' && *c != ')')
                .collect();
            if let Some(dir) = arg.strip_prefix("deploy/") {
                dirs.insert(format!("deploy/{}", dir.trim_end_matches('/')));
            }
        }
    }
    dirs
}

#[test]
fn the_build_context_leaves_out_every_secret() {
    let ignored: BTreeSet<String> = read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_start_matches('/').trim_end_matches('/').to_string())
        .collect();
    let secret_dirs = secret_directories();
    assert!(
        secret_dirs.contains("deploy/.secrets") && secret_dirs.contains("deploy/k8s/secrets"),
        "{secret_dirs:?}"
    );
    // Everything git keeps out (the local stack's state, caches, secrets) stays out of images too.
    let git_ignored = read(".gitignore")
        .lines()
        .map(|l| {
            l.trim()
                .trim_start_matches('/')
                .trim_end_matches('/')
                .to_string()
        })
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect::<BTreeSet<_>>();
    let missing: Vec<&String> = secret_dirs
        .iter()
        .chain(&git_ignored)
        .filter(|path| !ignored.contains(*path))
        .collect();
    assert!(
        missing.is_empty(),
        ".dockerignore does not exclude {missing:?} (the build context would carry it)"
    );
}

/// deploy/k8s's manifests against the Kubernetes 1.30 schemas (the oldest version the
/// manifests support: the preStop sleep action), strictly (unknown fields refused), with no
/// network: kubernetes-validate carries the schemas (installed by deploy/install-deps.sh).
#[test]
fn kubernetes_manifests_validate_against_the_schemas_offline() {
    let validator = repo().join(".cache/kubernetes-validate/bin/kubernetes-validate");
    assert!(
        validator.exists(),
        "{} is missing: run deploy/install-deps.sh",
        validator.display()
    );
    let validate = |files: &[PathBuf]| {
        // In a network namespace of its own: nothing can be fetched.
        let out = std::process::Command::new("unshare")
            .arg("--net")
            .arg(&validator)
            .args(["--strict", "--kubernetes-version", "1.30.0"])
            .args(files)
            .output()
            .expect("run kubernetes-validate");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let kustomization = &load_yaml("deploy/k8s/kustomization.yaml")[0];
    let files: Vec<PathBuf> = strings(&kustomization["resources"])
        .iter()
        .map(|f| repo().join("deploy/k8s").join(f))
        .collect();
    let (ok, report) = validate(&files);
    assert!(ok, "{report}");
    // Every object was validated, the Prometheus Operator's PodMonitor (a custom resource,
    // no schema) excepted.
    let passed = report.matches(" passed for resource ").count();
    let objects = k8s_documents().len();
    assert_eq!(passed, objects - 1, "{report}");
    assert!(report.contains("kind PodMonitor"), "{report}");

    // And it refuses what the API server would.
    let broken = testkit::scratch_dir("k8s-schema").join("broken.yaml");
    std::fs::write(
        &broken,
        read("deploy/k8s/consumers.yaml").replacen("replicas: 2", "replicas: two", 1),
    )
    .unwrap();
    let (ok, report) = validate(&[broken]);
    assert!(!ok, "a Deployment with `replicas: two` passed: {report}");
}

/// The names of `${NAME...}` references in a compose file or a shell script.
fn braced_refs(text: &str) -> Vec<String> {
    text.match_indices("${")
        .map(|(i, _)| {
            text[i + 2..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect()
}

/// Every variable the README and the docs name is one something reads: a binary (its clap
/// definitions), the compose file (`${NAME}`), the Kubernetes ConfigMap (a key), the local
/// stack, or a test knob. A documented variable nothing reads (`CDC_STREAM_SHARDS` said to
/// configure the receiving service, which reads `CHAT_INBOUND_STREAM_SHARDS`) fails here.
#[test]
fn every_documented_variable_is_read_by_something() {
    let mut known: BTreeSet<String> = binaries()
        .values()
        .flat_map(|subcommands| subcommands.values())
        .flat_map(|accepts| accepts.envs.iter().cloned())
        .collect();
    known.extend(braced_refs(&read("deploy/compose.yaml")));
    for (_, doc) in k8s_documents() {
        if string_or_empty(&doc["kind"]) == "ConfigMap" {
            known.extend(hash_keys(&doc["data"]));
        }
    }
    known.extend(braced_refs(&read("deploy/local.sh")));
    // Knobs the tests read (`std::env::var("...")`), e.g. how long the standby-load test runs.
    for dir in [
        "cdc-relay/tests",
        "chat-services/tests",
        "lab/tests",
        "lab/src",
    ] {
        for file in std::fs::read_dir(repo().join(dir)).unwrap().flatten() {
            let Ok(text) = std::fs::read_to_string(file.path()) else {
                continue;
            };
            for (i, _) in text.match_indices("env::var(\"") {
                let name: String = text[i + "env::var(\"".len()..]
                    .chars()
                    .take_while(|c| *c != '"')
                    .collect();
                known.insert(name);
            }
        }
    }
    let mut unread = BTreeSet::new();
    for path in ["README.md", "docs/deployment.md", "docs/operations.md"] {
        let text = read(path);
        let mut rest = text.as_str();
        while let Some(i) = rest.find(|c: char| c.is_ascii_uppercase()) {
            let word: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            rest = &rest[i + word.len().max(1)..];
            // A whole name (`CHAT_*` in prose is a prefix, not a variable).
            let ours = ["CDC_", "CHAT_", "DATABASE_", "REDIS_", "MIGRATE_", "LOG_"]
                .iter()
                .any(|prefix| word.starts_with(prefix) && word.len() > prefix.len())
                && !word.ends_with('_');
            if ours && !known.contains(&word) {
                unread.insert(format!("{path}: {word}"));
            }
        }
    }
    assert!(
        unread.is_empty(),
        "documented variables nothing reads:\n{}",
        unread.into_iter().collect::<Vec<_>>().join("\n")
    );
}
