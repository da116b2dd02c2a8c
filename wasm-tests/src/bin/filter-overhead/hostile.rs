//! `hostile`: the worst request bodies we could construct, each just under the filter's 4 MiB
//! cap, sent one at a time to the listener without a filter and to kvroute's: the time
//! kvroute adds inside V8 for each (median and worst of 10), the statuses Envoy answered, and
//! whether Envoy and its wasm VM came through. The cap bounds the work a body can cause; this
//! shows what that bound costs at its worst.

use std::time::Instant;

use kvroute_wasm_tests::fake_vllm::MODEL;
use kvroute_wasm_tests::http_client::KeepAlive;

use crate::common::bench_envoy;

/// Hostile request bodies just under `max_body_bytes` (4 MiB): (name, path, body).
fn hostile_bodies() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    const CAP: usize = (4 << 20) - 256;
    let chat = "/v1/chat/completions";
    let one = r#"{"role":"user","content":"hi"},"#;
    let many = format!(
        r#"{{"model":"{MODEL}","messages":[{}{{"role":"user","content":"end"}}]}}"#,
        one.repeat(CAP / one.len() - 2)
    );
    let escapes = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "\\u00e9".repeat(CAP / 6 - 20)
    );
    let plain = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "lorem ipsum ".repeat(CAP / 12 - 10)
    );
    let ids = format!(r#"{{"model":"{MODEL}","prompt":[{}1]}}"#, "1,".repeat(CAP / 2 - 20));
    let nested = format!(
        r#"{{"model":"{MODEL}","tools":{}{},"messages":[{{"role":"user","content":"x"}}]}}"#,
        "[".repeat(CAP / 2 - 100),
        "]".repeat(CAP / 2 - 100)
    );
    let duplicates = format!(
        r#"{{"model":"{MODEL}",{}"messages":[{{"role":"user","content":"x"}}]}}"#,
        r#""model":"m","#.repeat(CAP / 12 - 10)
    );
    let mut invalid_utf8 = plain.clone().into_bytes();
    for i in (100..invalid_utf8.len() - 100).step_by(4096) {
        invalid_utf8[i] = 0xff;
    }
    vec![
        (
            "4 MiB of plain text (hashing capped at max_blocks)",
            chat,
            plain.into_bytes(),
        ),
        ("130k tiny messages (stopped at 4096)", chat, many.into_bytes()),
        ("700k \\u escapes", chat, escapes.into_bytes()),
        ("2M token ids (completions)", "/v1/completions", ids.into_bytes()),
        ("2M-deep nesting in tools", chat, nested.into_bytes()),
        ("350k duplicate keys", chat, duplicates.into_bytes()),
        ("invalid UTF-8 every 4 KiB", chat, invalid_utf8),
    ]
}

pub fn hostile() -> Result<(), String> {
    let (_servers, envoy) = bench_envoy()?;
    println!("| body (just under 4 MiB) | bytes | median without | median with kvroute | added median | worst added | status |");
    println!("|---|---|---|---|---|---|---|");
    for (name, path, body) in hostile_bodies() {
        let mut clients = [KeepAlive::connect(envoy.port2)?, KeepAlive::connect(envoy.port)?];
        let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let mut statuses = std::collections::BTreeSet::new();
        for n in 0..12 {
            for (client, t) in clients.iter_mut().zip(times.iter_mut()) {
                let start = Instant::now();
                let status = client.post(path, &body)?;
                let took = start.elapsed().as_secs_f64() * 1e3;
                statuses.insert(status);
                if n >= 2 {
                    t.push(took); // 2 warm-up requests
                }
            }
        }
        // Each kvroute request against the no-filter request sent just before it.
        let worst_added = times[1]
            .iter()
            .zip(times[0].iter())
            .map(|(w, o)| w - o)
            .fold(f64::MIN, f64::max);
        for t in &mut times {
            t.sort_by(f64::total_cmp);
        }
        let med = |t: &[f64]| t[t.len() / 2];
        println!(
            "| {name} | {} | {:.1} ms | {:.1} ms | {:+.1} ms | {:+.1} ms | {:?} |",
            body.len(),
            med(&times[0]),
            med(&times[1]),
            med(&times[1]) - med(&times[0]),
            worst_added,
            statuses
        );
    }
    println!(
        "\nEnvoy alive: {}; wasm VM reloads: {}; kvroute skipped as malformed: {}.\n",
        envoy.stat("server.live") == 1,
        envoy.stat("wasm.kvroute.vm_reload"),
        envoy.stat("wasmcustom.kvroute.skipped.malformed")
    );
    Ok(())
}
