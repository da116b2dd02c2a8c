//! Helpers for tests and scripts that run a simulated fleet on loopback.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{serve_names, Options};
use crate::profile::Profile;

/// A base port `b` with `b − 1 ..= b + n` free on loopback (for tests and scripts that start
/// `n` servers and the admin listener), or `None`. Concurrent callers (tests run in parallel
/// threads and processes) start their scans at different places, so they rarely race for the
/// same ports; `start_in_background` also detects a lost race and moves on. The ports lie
/// below Linux's default range for outgoing connections' local ports (32768 up), where a
/// client socket could take one between the scan and the bind.
pub fn free_base_port(n: u16) -> Option<u16> {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let slots: Vec<u16> = (20_000..32_000u16).step_by(97).collect();
    let start = (std::process::id() as usize).wrapping_mul(31) + CALLS.fetch_add(1, Ordering::Relaxed) * 7;
    (0..slots.len())
        .map(|i| slots[(start + i) % slots.len()])
        .find(|b| (b - 1..=b + n).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()))
}

/// Waits until something accepts connections on `port` (false after `timeout`).
pub fn wait_listening(port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Starts `n` servers on free loopback ports in a runtime of their own (for tests): returns
/// the runtime (dropping it stops the servers) and the base port; the admin port is base − 1.
/// They answer to the profile's model name and to `m` (the short name tests send), with
/// `serve`'s defaults (no admission limits, no response store).
pub fn start_in_background(
    profile: Profile,
    n: u16,
    time_scale: f64,
) -> anyhow::Result<(tokio::runtime::Runtime, u16)> {
    start_in_background_with(profile, n, time_scale, Options::default())
}

/// `start_in_background` with servers that store Responses API responses (`serve
/// --responses-store`, vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`).
pub fn start_storing_in_background(
    profile: Profile,
    n: u16,
    time_scale: f64,
) -> anyhow::Result<(tokio::runtime::Runtime, u16)> {
    let options = Options {
        responses_store: true,
        ..Options::default()
    };
    start_in_background_with(profile, n, time_scale, options)
}

/// `start_in_background` with these `options` (`serve`'s flags).
pub fn start_in_background_with(
    profile: Profile,
    n: u16,
    time_scale: f64,
    options: Options,
) -> anyhow::Result<(tokio::runtime::Runtime, u16)> {
    for _ in 0..5 {
        let base = free_base_port(n).ok_or_else(|| anyhow::anyhow!("no {n} free ports on loopback"))?;
        let rt = tokio::runtime::Runtime::new()?;
        let p = profile.clone();
        let names = vec![profile.model.served_name().to_string(), "m".to_string()];
        let task = rt.spawn(async move {
            serve_names(
                p,
                usize::from(n),
                "127.0.0.1",
                base,
                base - 1,
                time_scale,
                names,
                options,
            )
            .await
        });
        // Until someone listens on every port, or `serve` returned because it could not bind
        // one (another caller took it between the scan and the bind): then try elsewhere.
        let listening = || (base - 1..base + n).all(|p| std::net::TcpStream::connect(("127.0.0.1", p)).is_ok());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !task.is_finished() && !listening() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "simulated servers on ports {}..={} did not start",
                base - 1,
                base + n - 1
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        if !task.is_finished() {
            return Ok((rt, base));
        }
    }
    anyhow::bail!("could not start {n} simulated servers: every port range tried was taken")
}
