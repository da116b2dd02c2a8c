//! Runs the real Envoy (from `.venv/`, or `KVROUTE_ENVOY`) with one of the shipped configs
//! in `envoy/`, its ports and pool rewritten to the test's, from the repository root so
//! `dist/kvroute.wasm` loads. The process is killed when the handle drops.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::http_client;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A shipped config's text with the shipped capture access log
/// (`envoy/capture/access-log.yaml`) on its first `stat_prefix: inference` listener, writing
/// to `path`, and `capture` (a JSON object's fields) added to kvroute's configuration after
/// the field `after` (its exact text in the config).
pub fn with_capture(text: &str, path: &Path, after: &str, capture: &str) -> String {
    let anchor = "                stat_prefix: inference\n";
    assert!(text.contains(anchor) && text.contains(after), "the Envoy config moved");
    text.replacen(anchor, &format!("{anchor}{}", capture_log(path)), 1)
        .replacen(after, &format!("{after}, \"capture\": {{{capture}}}"), 1)
}

/// The shipped capture access log (`envoy/capture/access-log.yaml`) indented for an
/// `http_connection_manager` of the shipped configs, writing to `path`.
pub fn capture_log(path: &Path) -> String {
    let snippet = std::fs::read_to_string(repo_root().join("envoy/capture/access-log.yaml")).unwrap_or_default();
    snippet
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("                {l}\n"))
        .collect::<String>()
        .replace("/var/log/kvroute/capture.jsonl", &path.to_string_lossy())
}

/// Ports this test process handed out to be bound later (by an Envoy it starts): tests
/// run side by side, and a port released by `free_port` is free for the next `bind(0)`,
/// a fake server's included, until the Envoy binds it (CI saw a replica's fixed listener
/// port taken that way). Every port chosen here, and every fake server's, avoids them.
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A listener on a kernel-chosen port of 127.0.0.1 that no test of this process was
/// handed by `free_port` / `free_ports`.
pub fn bind_unclaimed() -> std::io::Result<TcpListener> {
    let mut rejected = Vec::new();
    loop {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        let handed = HANDED_OUT.lock().map(|h| h.contains(&port)).unwrap_or(false);
        if !handed || rejected.len() >= 64 {
            return Ok(l);
        }
        // Held until a port is found, so the next bind gets another one.
        rejected.push(l);
    }
}

/// Records `port` as handed out; false when it already was.
fn claim(port: u16) -> bool {
    HANDED_OUT.lock().map(|mut h| h.insert(port)).unwrap_or(true)
}

pub fn free_port() -> u16 {
    free_ports(1, &[])[0]
}

/// `n` distinct free ports, none in `taken`: each is held until all are chosen (a port
/// released at once may be handed out again by the next bind, and an Envoy whose listener
/// and admin got the same port cannot start).
pub fn free_ports(n: usize, taken: &[u16]) -> Vec<u16> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    while ports.len() < n && held.len() < n + 16 {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else { break };
        let port = l.local_addr().map(|a| a.port()).unwrap_or(0);
        if port != 0 && !taken.contains(&port) && !ports.contains(&port) && claim(port) {
            ports.push(port);
        }
        held.push(l);
    }
    ports.resize(n, 0);
    ports
}

pub struct Envoy {
    child: Child,
    pub port: u16,
    /// The second listener of configs that have one (`port_value: 10001`).
    pub port2: u16,
    /// The third listener of configs that have one (`port_value: 10002`).
    pub port3: u16,
    pub admin: u16,
    pub log: PathBuf,
    _dir: tempdir::Dir,
}

mod tempdir {
    use std::path::PathBuf;
    pub struct Dir(pub PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Envoy {
    /// Starts `envoy/<config>` with the pool `127.0.0.1:8001..8004` replaced by `pool`
    /// (in order; entries past `pool.len()` are dropped) and `edit` applied to the config text; waits until it is ready.
    pub fn start(config: &str, pool: &[u16], edit: impl Fn(String) -> String) -> Result<Envoy, String> {
        let path = repo_root().join("envoy").join(config);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::start_text(text, pool, edit)
    }

    /// Like `start`, with `workers` Envoy worker threads (`--concurrency`) instead of 2.
    pub fn start_workers(
        config: &str,
        pool: &[u16],
        workers: u32,
        edit: impl Fn(String) -> String,
    ) -> Result<Envoy, String> {
        Self::start_listening(config, pool, workers, None, edit)
    }

    /// Like `start_workers`, with the main listener on `listen` (a port chosen before the
    /// config is written, for configs that must name it) when given.
    pub fn start_listening(
        config: &str,
        pool: &[u16],
        workers: u32,
        listen: Option<u16>,
        edit: impl Fn(String) -> String,
    ) -> Result<Envoy, String> {
        let path = repo_root().join("envoy").join(config);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::start_with(text, pool, workers, listen, edit)
    }

    /// Like `start`, from config text already in hand.
    pub fn start_text(text: String, pool: &[u16], edit: impl Fn(String) -> String) -> Result<Envoy, String> {
        Self::start_with(text, pool, 2, None, edit)
    }

    /// Starts Envoy, again on fresh ports when one it was given was taken meanwhile: a port
    /// is free when chosen and bound by Envoy a moment later, and a test running beside it
    /// may bind it in between (CI saw `cannot bind … Address already in use` once).
    fn start_with(
        text: String,
        pool: &[u16],
        workers: u32,
        listen: Option<u16>,
        edit: impl Fn(String) -> String,
    ) -> Result<Envoy, String> {
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::start_once(text.clone(), pool, workers, listen, &edit) {
                Err(e) if tries < 3 && e.contains("Address already in use") => continue,
                result => return result,
            }
        }
    }

    fn start_once(
        mut text: String,
        pool: &[u16],
        workers: u32,
        listen: Option<u16>,
        edit: &impl Fn(String) -> String,
    ) -> Result<Envoy, String> {
        let root = repo_root();
        let binary = std::env::var("KVROUTE_ENVOY")
            .map(PathBuf::from)
            .unwrap_or_else(|_| root.join(".venv/bin/envoy"));
        if !binary.exists() {
            return Err(format!("no Envoy at {}: run `make setup-envoy`", binary.display()));
        }
        if !root.join("dist/kvroute.wasm").exists() {
            return Err("no dist/kvroute.wasm: run `make build-wasm`".into());
        }
        let taken: Vec<u16> = listen.iter().copied().chain(pool.iter().copied()).collect();
        let fresh = free_ports(4, &taken);
        let port = listen.unwrap_or(fresh[0]);
        let (port2, port3, admin) = (fresh[1], fresh[2], fresh[3]);
        for (i, p) in pool.iter().enumerate() {
            let old = 8001 + i;
            text = text.replace(&format!("127.0.0.1:{old}"), &format!("127.0.0.1:{p}"));
            text = text.replace(&format!("port_value: {old} "), &format!("port_value: {p} "));
        }
        for unused in 8001 + pool.len()..=8004 {
            text = text.replace(&format!(", \"127.0.0.1:{unused}\""), "");
            text = text
                .lines()
                .filter(|l| !l.contains(&format!("port_value: {unused} ")))
                .collect::<Vec<_>>()
                .join("\n");
        }
        text = text.replace("port_value: 10000", &format!("port_value: {port}"));
        text = text.replace("port_value: 10001", &format!("port_value: {port2}"));
        text = text.replace("port_value: 10002", &format!("port_value: {port3}"));
        text = text.replace("port_value: 9901", &format!("port_value: {admin}"));
        let text = edit(text);
        let dir = std::env::temp_dir().join(format!("kvroute-e2e-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let dir = tempdir::Dir(dir);
        let cfg = dir.0.join("envoy.yaml");
        let log = dir.0.join("envoy.log");
        std::fs::write(&cfg, text).map_err(|e| e.to_string())?;
        // Logs go to stderr, captured in a file: Envoy flushes a --log-path file only now
        // and then, and tests read the log while Envoy runs.
        let log_file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let child = Command::new(&binary)
            .current_dir(&root)
            .args([
                "-c",
                cfg.to_str().unwrap_or_default(),
                "--concurrency",
                &workers.to_string(),
                "--use-dynamic-base-id",
                "-l",
                "info",
            ])
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        let mut envoy = Envoy {
            child,
            port,
            port2,
            port3,
            admin,
            log,
            _dir: dir,
        };
        envoy.wait_ready()?;
        Ok(envoy)
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("Envoy exited with {status}:\n{}", self.log_text()));
            }
            if http_client::request(self.admin, "GET", "/ready", &[], b"").is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(50));
        }
        Err(format!("Envoy not ready after 30 s:\n{}", self.log_text()))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits (10 s at most, then panics with Envoy's log) until kvroute counts `servers`
    /// healthy scraped servers, then 300 ms more for a worker tick to take the snapshot.
    pub fn wait_scraped(&self, servers: u64) {
        let healthy = "wasmcustom.kvroute.scrape.healthy_endpoints";
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.stat(healthy) < servers {
            assert!(
                std::time::Instant::now() < deadline,
                "not every server scraped:\n{}",
                self.log_text()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
    }

    /// From one read of the admin `/stats`: the requests the inference listener saw, and
    /// those kvroute counted under one of its outcomes (the sum the failing-open alert
    /// compares them with, `kvroute:requests_total` in envoy/observability/kvroute-rules.yaml).
    pub fn requests_accounted(&self) -> (u64, u64) {
        const OUTCOMES: [&str; 14] = [
            "decision.prefix_hit",
            "decision.cold",
            "decision.fallback",
            "decision.shed",
            "decision.response_home",
            "passthrough",
            "peer_batch",
            "skipped.over_limit",
            "skipped.malformed",
            "skipped.error",
            "hold.expired",
            "hold.refused",
            "hold.gone",
            "hold.unavailable",
        ];
        let body = self.admin_stats("/stats");
        let value = |name: &str| stat_in(&body, name).unwrap_or(0);
        let counted = OUTCOMES.iter().map(|n| value(&format!("wasmcustom.kvroute.{n}"))).sum();
        (value("http.inference.downstream_rq_total"), counted)
    }

    /// A counter or gauge from the admin `/stats` (0 when absent).
    pub fn stat(&self, name: &str) -> u64 {
        self.stat_if_defined(name).unwrap_or(0)
    }

    /// A stat's value, `None` when Envoy has no stat of that name (a check that a figure is
    /// 0 must not pass on a misspelt name). An admin read that fails is tried again, and
    /// panics after the last try: read as "no stat", it would pass a check that a figure is
    /// 0 and fail one that it grew (a loaded CI machine saw such a read once).
    pub fn stat_if_defined(&self, name: &str) -> Option<u64> {
        stat_in(&self.admin_stats(&format!("/stats?filter=^{name}$")), name)
    }

    /// The admin's answer at `path` (`/stats...`), tried again when the read fails.
    fn admin_stats(&self, path: &str) -> String {
        let mut tries = 0;
        loop {
            match http_client::request(self.admin, "GET", path, &[], b"") {
                Ok(r) if r.status == 200 => return r.body,
                _ if tries < 4 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                Ok(r) => panic!("admin GET {path}: status {}: {}", r.status, r.body),
                Err(e) => panic!("admin GET {path}: {e}"),
            }
        }
    }

    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Result<http_client::Response, String> {
        http_client::request(self.port, "POST", path, headers, body.as_bytes())
    }
}

/// Stat `name`'s value in the admin's `/stats` text.
fn stat_in(body: &str, name: &str) -> Option<u64> {
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")).and_then(|v| v.trim().parse().ok()))
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A shipped config's text with the gateway replicas' cluster
/// (`envoy/fragments/replicas-cluster.yaml`) naming the two replicas' peer listeners `peers`.
pub fn with_replicas_cluster(text: &str, peers: [u16; 2]) -> String {
    let fragment = std::fs::read_to_string(repo_root().join("envoy/fragments/replicas-cluster.yaml"))
        .expect("envoy/fragments/replicas-cluster.yaml");
    let cluster: String = fragment
        .lines()
        .filter(|l| !l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("port_value: 10100", &format!("port_value: {}", peers[0]))
        .replace("port_value: 10200", &format!("port_value: {}", peers[1]));
    text.replace("  clusters:\n", &format!("  clusters:\n{cluster}\n"))
}

/// Removes the `bootstrap_extensions` block (the singleton service), moving the plugin
/// configuration it anchors into the HTTP filter.
pub fn without_service(text: &str) -> String {
    let start = text.find("bootstrap_extensions:").unwrap();
    let end = text.find("static_resources:").unwrap();
    let block = &text[start..end];
    let anchor = "value: &kvroute_config |\n";
    let json_start = block.find(anchor).unwrap() + anchor.len();
    let json: Vec<&str> = block[json_start..]
        .lines()
        .take_while(|l| l.starts_with("            ") || l.trim().is_empty())
        .filter(|l| !l.trim().is_empty())
        .collect();
    let rest = format!("{}{}", &text[..start], &text[end..]);
    let alias = rest.lines().find(|l| l.trim() == "value: *kvroute_config").unwrap();
    let indent = " ".repeat(alias.len() - alias.trim_start().len() + 2);
    let inline: String = json.iter().map(|l| format!("{indent}{}\n", l.trim())).collect();
    rest.replace(
        alias,
        &format!(
            "{}value: |\n{}",
            &alias[..alias.len() - alias.trim_start().len()],
            inline.trim_end()
        ),
    )
}
