//! The files in `deploy/` (issue 6, "Must show" 2). CI has no container engine and no
//! systemd, so this test checks what can be checked without them: the Kubernetes manifest,
//! the alert rules and the dashboard parse; every metric they read is in the catalogue; the
//! manifest's probes, ports, mounts and scrape annotations agree with the sidecar's arguments;
//! `turnguard serve` starts with exactly the manifest's arguments and environment (addresses
//! moved to free ports, absolute paths moved under a temporary root) and answers the probes;
//! the systemd unit's `ExecStart` does the same, and its `ExecStartPre` passes on the
//! manifest's policy bundle (and fails on a broken one).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::type_complexity
)] // test code

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

fn deploy(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(deploy(rel)).unwrap_or_else(|e| panic!("deploy/{rel}: {e}"))
}

/// The exported metric names of the catalogue in deploy/README.md.
fn catalogue() -> BTreeSet<String> {
    let readme = read("README.md");
    let section = readme.split("## Metrics catalogue").nth(1).unwrap();
    let exported = section.split("### Planned").next().unwrap();
    exported
        .lines()
        .filter_map(|l| l.strip_prefix("| `turnguard_"))
        .map(|l| format!("turnguard_{}", l.split('`').next().unwrap()))
        .collect()
}

/// Metric families an expression reads (`_bucket`/`_sum`/`_count` series map to their
/// histogram).
fn metrics_in(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("turnguard_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        out.insert(family.to_owned());
        rest = &tail[end..];
    }
    out
}

fn manifest() -> Vec<Yaml> {
    manifest_of("k8s/turnguard-sidecar.yaml")
}

fn manifest_of(rel: &str) -> Vec<Yaml> {
    let text = read(rel);
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Yaml::deserialize(doc).expect("each YAML document parses"))
        .filter(|d| !d.is_null())
        .collect()
}

use serde::Deserialize;

fn kind<'a>(docs: &'a [Yaml], kind: &str) -> &'a Yaml {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in the manifest"))
}

fn strs(v: &Yaml) -> Vec<String> {
    v.as_sequence()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

/// `--name=value` from an argument list.
fn flag(args: &[String], name: &str) -> String {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("--{name}=")))
        .unwrap_or_else(|| panic!("no --{name}= in {args:?}"))
        .to_owned()
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':').unwrap().1.parse().unwrap()
}

#[test]
fn the_kubernetes_manifest_runs_turnguard_as_a_native_sidecar() {
    let docs = manifest();
    let deployment = kind(&docs, "Deployment");
    let pod = &deployment["spec"]["template"];
    let spec = &pod["spec"];
    let sidecar = spec["initContainers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "turnguard")
        .expect("turnguard is an init container");
    assert_eq!(
        sidecar["restartPolicy"], "Always",
        "a native sidecar is an init container with restartPolicy: Always"
    );
    let args = strs(&sidecar["args"]);
    assert_eq!(args[0], "serve");
    let listen = flag(&args, "listen");
    let admin = flag(&args, "admin-listen");
    assert!(
        listen.starts_with("127.0.0.1:"),
        "the data plane stays on loopback"
    );
    let admin_port = port_of(&admin);

    // Probes on the admin port, by name or number.
    let named: Vec<&Yaml> = sidecar["ports"].as_sequence().unwrap().iter().collect();
    let resolve = |p: &Yaml| -> u16 {
        match p.as_u64() {
            Some(n) => n as u16,
            None => named
                .iter()
                .find(|n| n["name"] == *p)
                .and_then(|n| n["containerPort"].as_u64())
                .expect("named port exists") as u16,
        }
    };
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let get = &sidecar[probe]["httpGet"];
        assert_eq!(
            resolve(&get["port"]),
            admin_port,
            "{probe} on the admin port"
        );
        assert!(
            ["/readyz", "/healthz"].contains(&get["path"].as_str().unwrap()),
            "{probe}"
        );
    }
    let ann = &pod["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(
        ann["prometheus.io/port"].as_str().unwrap(),
        admin_port.to_string()
    );
    assert_eq!(ann["prometheus.io/path"], "/metrics");

    // Hardening.
    let sc = &sidecar["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["runAsUser"], 65532);
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);

    // The policy comes from the ConfigMap, the journal lives on a volume.
    let mounts = sidecar["volumeMounts"].as_sequence().unwrap();
    let mount_of = |path: &str| -> String {
        mounts
            .iter()
            .find(|m| path.starts_with(m["mountPath"].as_str().unwrap()))
            .unwrap_or_else(|| panic!("{path} is on no volume"))["name"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let volumes = spec["volumes"].as_sequence().unwrap();
    let volume = |name: &str| volumes.iter().find(|v| v["name"] == name).unwrap();
    let policy_volume = volume(&mount_of(&flag(&args, "policy")));
    let cm = policy_volume["configMap"]["name"].as_str().unwrap();
    assert_eq!(kind(&docs, "ConfigMap")["metadata"]["name"], cm);
    let journal_volume = volume(&mount_of(&flag(&args, "journal")));
    assert!(
        journal_volume.get("emptyDir").is_some()
            || journal_volume.get("persistentVolumeClaim").is_some()
    );

    // The agent points at the sidecar's data plane; the grace period covers the drain.
    let agent = &spec["containers"][0];
    let base = agent["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "OPENAI_BASE_URL")
        .unwrap()["value"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(base, format!("http://{listen}/v1"));
    let grace_ms: u64 = flag(&args, "shutdown-grace-ms").parse().unwrap();
    assert!(spec["terminationGracePeriodSeconds"].as_u64().unwrap() * 1000 > grace_ms);
}

/// The shared-service example (issue 15): 3 replicas on one PostgreSQL journal given by a
/// Secret, a Service in front, the data plane open only to labelled clients, probes and
/// scrape on the admin port; on the PostgreSQL backend, `turnguard serve` starts with the
/// manifest's arguments and its `TURNGUARD_JOURNAL` pointed at the test cluster.
#[test]
fn the_replicas_manifest_runs_three_turnguards_on_one_postgresql_journal() {
    let docs = manifest_of("k8s/turnguard-replicas.yaml");
    let deployment = kind(&docs, "Deployment");
    assert_eq!(deployment["spec"]["replicas"], 3);
    let pod = &deployment["spec"]["template"];
    let tg = pod["spec"]["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "turnguard")
        .expect("turnguard container");
    let args = strs(&tg["args"]);
    assert_eq!(args[0], "serve");
    assert!(
        !args.iter().any(|a| a.starts_with("--journal")),
        "the journal URL (a secret) is not an argument: {args:?}"
    );
    // TURNGUARD_JOURNAL comes from the Secret, and it is a PostgreSQL URL.
    let env = tg["env"].as_sequence().unwrap();
    let journal = env
        .iter()
        .find(|e| e["name"] == "TURNGUARD_JOURNAL")
        .expect("TURNGUARD_JOURNAL is set");
    let key_ref = &journal["valueFrom"]["secretKeyRef"];
    let secret = docs
        .iter()
        .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == key_ref["name"])
        .expect("the Secret it names is in the manifest");
    let url = secret["stringData"][key_ref["key"].as_str().unwrap()]
        .as_str()
        .unwrap();
    assert!(url.starts_with("postgres://"), "{url}");
    // Probes and scrape on the admin port; the Service targets the data port.
    let admin_port = port_of(&flag(&args, "admin-listen"));
    let data_port = port_of(&flag(&args, "listen"));
    let port_named = |name: &str| -> u64 {
        tg["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("port {name}"))
    };
    assert_eq!(port_named("admin"), u64::from(admin_port));
    assert_eq!(port_named("data"), u64::from(data_port));
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(tg[probe]["httpGet"]["port"], "admin", "{probe}");
    }
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/port"]
            .as_str()
            .unwrap(),
        admin_port.to_string()
    );
    let service = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "turnguard")
        .expect("a Service named turnguard");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "data");
    // Only labelled clients reach the data plane; only turnguard reaches PostgreSQL.
    let policies: Vec<&Yaml> = docs
        .iter()
        .filter(|d| d["kind"] == "NetworkPolicy")
        .collect();
    let data_rule = policies
        .iter()
        .find(|p| p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "turnguard")
        .expect("a NetworkPolicy on turnguard's pods");
    let rules = data_rule["spec"]["ingress"].as_sequence().unwrap();
    assert!(rules
        .iter()
        .all(|r| r["from"].as_sequence().is_some_and(|f| !f.is_empty())));
    assert!(rules
        .iter()
        .any(|r| r["ports"][0]["port"] == u64::from(data_port)
            && r["from"][0]["podSelector"]["matchLabels"]["turnguard-client"] == "true"));
    assert!(policies
        .iter()
        .any(
            |p| p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                == "turnguard-postgres"
        ));
    assert_eq!(
        kind(&docs, "PodDisruptionBudget")["spec"]["minAvailable"],
        2
    );
    let sc = &tg["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);

    if crate::support::db::backend() != crate::support::Backend::Postgres {
        eprintln!(
            "the_replicas_manifest_…: the serve check needs PostgreSQL \
             (TURNGUARD_TEST_BACKEND=postgres); the manifest checks above ran"
        );
        return;
    }
    let root = tempfile::tempdir().unwrap();
    materialize_policy(&docs, &root.path().join("etc/turnguard/policy"));
    let url = crate::support::journal_arg(&root.path().join("journal.db"));
    serve_and_probe(
        &args,
        &[("TURNGUARD_JOURNAL".to_owned(), url)],
        root.path(),
        &["/readyz", "/healthz", "/metrics"],
    );
}

#[test]
fn alert_rules_and_dashboard_parse_and_read_only_catalogued_metrics() {
    let catalogue = catalogue();
    let rules: Yaml = serde_yaml::from_str(&read("prometheus/turnguard-alerts.yaml")).unwrap();
    let mut alerts = BTreeSet::new();
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let name = rule["alert"].as_str().expect("every rule is an alert");
            let expr = rule["expr"].as_str().unwrap();
            let used = metrics_in(expr);
            assert!(!used.is_empty(), "{name} reads no turnguard metric");
            for m in &used {
                assert!(
                    catalogue.contains(m),
                    "{name} reads `{m}`, not in the catalogue"
                );
            }
            assert!(rule["labels"]["severity"].as_str().is_some(), "{name}");
            assert!(rule["annotations"]["summary"].as_str().is_some(), "{name}");
            alerts.insert(name.to_owned());
        }
    }
    for needed in [
        "TurnguardUpstreamErrors",
        "TurnguardJournalWriteFailures",
        "TurnguardShedding",
    ] {
        assert!(alerts.contains(needed), "missing alert {needed}");
    }
    // Every alert is named in the catalogue's "feeds" column.
    let readme = read("README.md");
    for a in &alerts {
        assert!(
            readme.contains(a.as_str()),
            "{a} is not documented in deploy/README.md"
        );
    }

    let dash: Json = serde_json::from_str(&read("grafana/turnguard-dashboard.json")).unwrap();
    assert!(dash["title"].as_str().is_some());
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 8);
    let mut read_by_dashboard = BTreeSet::new();
    for p in panels {
        let targets = p["targets"].as_array().expect("every panel has targets");
        assert!(!targets.is_empty(), "{}", p["title"]);
        for t in targets {
            for m in metrics_in(t["expr"].as_str().unwrap()) {
                assert!(catalogue.contains(&m), "panel {} reads `{m}`", p["title"]);
                read_by_dashboard.insert(m);
            }
        }
    }
    for var in dash["templating"]["list"].as_array().unwrap() {
        for m in metrics_in(var["query"].as_str().unwrap_or_default()) {
            assert!(
                catalogue.contains(&m),
                "variable {} reads `{m}`",
                var["name"]
            );
            read_by_dashboard.insert(m);
        }
    }
    for m in &catalogue {
        assert!(
            read_by_dashboard.contains(m),
            "`{m}` is catalogued but on no dashboard panel"
        );
    }
}

#[test]
fn the_dockerfile_is_multi_stage_non_root_with_the_journal_on_a_volume() {
    let text = read("Dockerfile");
    let froms = text.lines().filter(|l| l.starts_with("FROM ")).count();
    assert!(froms >= 2, "multi-stage");
    assert!(text.lines().any(|l| l.trim() == "USER 65532:65532"));
    assert!(text.contains("VOLUME [\"/var/lib/turnguard\"]"));
    assert!(text.contains("TURNGUARD_JOURNAL=/var/lib/turnguard/"));
    assert!(text.contains("SQLITE_TMPDIR=/var/lib/turnguard"));
    assert!(text.contains("--locked"));
    // src/reload.rs embeds the default bundle: the build context must carry policy/.
    assert!(text.contains("COPY policy ./policy"));
    assert!(read("Dockerfile.dockerignore").contains("!policy/**"));
}

/// Rewrites absolute paths under `root` and addresses to free ports (same host).
fn localize(arg: &str, root: &Path) -> String {
    let Some((name, value)) = arg.split_once('=') else {
        return arg.to_owned();
    };
    if let Some(rel) = value.strip_prefix('/') {
        return format!("{name}={}", root.join(rel).display());
    }
    if name == "--listen" || name == "--admin-listen" {
        let host = value.rsplit_once(':').unwrap().0;
        return format!("{name}={host}:{}", crate::support::free_port());
    }
    arg.to_owned()
}

fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, buf.split_once("\r\n\r\n")?.1.to_owned()))
}

/// Writes the ConfigMap's files where its `items` put them, under `dir`.
fn materialize_policy(docs: &[Yaml], dir: &Path) {
    let cm = kind(docs, "ConfigMap");
    let deployment = kind(docs, "Deployment");
    let volume = deployment["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["configMap"]["name"] == cm["metadata"]["name"])
        .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let data = cm["data"].as_mapping().unwrap();
    match volume["configMap"]["items"].as_sequence() {
        Some(items) => {
            for item in items {
                let target = dir.join(item["path"].as_str().unwrap());
                std::fs::create_dir_all(target.parent().unwrap()).unwrap();
                std::fs::write(&target, data[&item["key"]].as_str().unwrap()).unwrap();
            }
        }
        None => {
            for (k, v) in data {
                std::fs::write(dir.join(k.as_str().unwrap()), v.as_str().unwrap()).unwrap();
            }
        }
    }
}

/// Runs `turnguard ARGS` (localized) with `env`, checks it becomes ready and answers
/// `probe_paths` with 200 on the admin plane and a 404 on the data plane, then SIGTERM → 0.
fn serve_and_probe(args: &[String], env: &[(String, String)], root: &Path, probe_paths: &[&str]) {
    let args: Vec<String> = args.iter().map(|a| localize(a, root)).collect();
    // The journal is a path argument (the sidecar) or a URL in the environment (replicas).
    let journal = args
        .iter()
        .find_map(|a| a.strip_prefix("--journal="))
        .map(PathBuf::from);
    if let Some(j) = &journal {
        std::fs::create_dir_all(j.parent().unwrap()).unwrap();
    }
    let admin = flag(&args, "admin-listen").replace("0.0.0.0", "127.0.0.1");
    let data = flag(&args, "listen");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_turnguard"));
    cmd.args(&args)
        .current_dir(root)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(
            k,
            localize(&format!("x={v}"), root).trim_start_matches("x="),
        );
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((200, _)) = http_get(&admin, "/readyz") {
            break;
        }
        if let Ok(Some(s)) = child.try_wait() {
            panic!("turnguard {args:?} exited with {s}");
        }
        assert!(Instant::now() < deadline, "not ready within 20 s: {args:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for path in probe_paths {
        let (status, body) = http_get(&admin, path).unwrap();
        assert_eq!(status, 200, "{path}: {body}");
        if *path == "/metrics" {
            assert!(body.contains("turnguard_build_info"), "{body}");
        }
    }
    let (status, body) = http_get(&data, "/not/a/provider/path").unwrap();
    assert_eq!(status, 404);
    assert!(body.contains("\"not_found\""));
    if let Some(j) = &journal {
        assert!(j.exists(), "the journal is where the arguments put it");
    }
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

#[test]
fn turnguard_serve_runs_with_the_kubernetes_manifests_arguments() {
    let docs = manifest();
    let spec = &kind(&docs, "Deployment")["spec"]["template"]["spec"];
    let sidecar = spec["initContainers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "turnguard")
        .unwrap();
    let args = strs(&sidecar["args"]);
    let env: Vec<(String, String)> = sidecar["env"]
        .as_sequence()
        .map(|list| {
            list.iter()
                .map(|e| {
                    (
                        e["name"].as_str().unwrap().to_owned(),
                        e["value"].as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let root = tempfile::tempdir().unwrap();
    let policy = localize(&format!("--policy={}", flag(&args, "policy")), root.path());
    materialize_policy(&docs, Path::new(policy.trim_start_matches("--policy=")));
    let mut probes: Vec<&str> = ["startupProbe", "readinessProbe", "livenessProbe"]
        .iter()
        .map(|p| sidecar[*p]["httpGet"]["path"].as_str().unwrap())
        .collect();
    probes.push("/metrics");
    serve_and_probe(&args, &env, root.path(), &probes);
}

/// The unit's `Key=value` lines (a key may repeat).
fn unit() -> Vec<(String, String)> {
    read("systemd/turnguard.service")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

fn unit_value(key: &str) -> String {
    unit()
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key}= in the unit"))
        .1
}

#[test]
fn the_systemd_unit_is_hardened_and_its_exec_start_serves() {
    for (key, value) in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("DynamicUser", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ("MemoryDenyWriteExecute", "yes"),
        ("StateDirectory", "turnguard"),
        ("KillSignal", "SIGTERM"),
    ] {
        assert_eq!(unit_value(key), value, "{key}");
    }
    let exec: Vec<String> = unit_value("ExecStart")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert_eq!(exec[0], "/usr/local/bin/turnguard");
    let args = exec[1..].to_vec();
    let grace_ms: u64 = flag(&args, "shutdown-grace-ms").parse().unwrap();
    let stop_s: u64 = unit_value("TimeoutStopSec").parse().unwrap();
    assert!(
        stop_s * 1000 > grace_ms,
        "systemd waits longer than the drain"
    );
    assert!(
        flag(&args, "journal").starts_with("/var/lib/turnguard/"),
        "on the StateDirectory"
    );
    let root = tempfile::tempdir().unwrap();
    let policy = localize(&format!("--policy={}", flag(&args, "policy")), root.path());
    materialize_policy(
        &manifest(),
        Path::new(policy.trim_start_matches("--policy=")),
    );
    serve_and_probe(
        &args,
        &[],
        root.path(),
        &["/healthz", "/readyz", "/metrics"],
    );
}

/// The unit's `ExecStartPre` (`turnguard policy check DIR`) on the bundle the Kubernetes
/// manifest ships, and on a broken copy of it.
#[test]
fn the_systemd_units_exec_start_pre_passes_on_the_shipped_bundle() {
    let pre: Vec<String> = unit_value("ExecStartPre")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert_eq!(pre[0], "/usr/local/bin/turnguard");
    assert_eq!(&pre[1..3], ["policy", "check"]);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join(pre[3].trim_start_matches('/'));
    materialize_policy(&manifest(), &dir);
    let out = Command::new(env!("CARGO_BIN_EXE_turnguard"))
        .args(["policy", "check"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "policy check failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        !report.contains("no rule permits"),
        "the shipped bundle must permit calls, not deny everything: {report}"
    );
    // A broken bundle must stop the unit from starting.
    std::fs::write(dir.join("turnguard.toml"), "mode = \"enforec\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_turnguard"))
        .args(["policy", "check"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success(), "a misspelt mode must fail the check");
}
