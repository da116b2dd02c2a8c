//! Helpers for tests and scripts that run a simulated fleet on loopback.

use std::time::{Duration, Instant};

use super::serve;
use crate::profile::Profile;

/// A base port `b` with `b − 1 ..= b + n` free on loopback (for tests and scripts that start
/// `n` servers and the admin listener), or `None`.
pub fn free_base_port(n: u16) -> Option<u16> {
    (20_000..40_000u16)
        .step_by(97)
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
pub fn start_in_background(
    profile: Profile,
    n: u16,
    time_scale: f64,
) -> anyhow::Result<(tokio::runtime::Runtime, u16)> {
    let base = free_base_port(n).ok_or_else(|| anyhow::anyhow!("no {n} free ports on loopback"))?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.spawn(async move { serve(profile, usize::from(n), "127.0.0.1", base, base - 1, time_scale, false).await });
    for port in base - 1..base + n {
        anyhow::ensure!(
            wait_listening(port, Duration::from_secs(10)),
            "simulated server on port {port} did not start"
        );
    }
    Ok((rt, base))
}
