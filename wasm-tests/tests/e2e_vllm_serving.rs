//! End to end: what vLLM's serving options mean for kvroute, through real Envoy and
//! dist/kvroute.wasm in front of simulated vLLM servers started with them.
//!
//! - `--enable-force-include-usage`: every stream carries the usage, asked for or not, at its
//!   end and (as vLLM forces `continuous_usage_stats` with it) on each chunk; kvroute learns
//!   that a server sends it and reads the cached tokens of streams that did not ask.
//! - Anthropic's `/v1/messages`: vLLM's translation reports the cached tokens as
//!   `cache_read_input_tokens` (absent when nothing was cached); kvroute reads them.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // wall-time test helpers

use kvroute_sim::profile::{Gpu, Model, Profile};
use kvroute_sim::serve::Options;
use kvroute_wasm_tests::envoy::Envoy;

const SERVERS: u16 = 2;

/// `SERVERS` simulated servers started with `options`, and their runtime (the fleet lives as
/// long as it does).
fn fleet(options: Options) -> (tokio::runtime::Runtime, Vec<u16>) {
    let profile = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1).unwrap();
    let (rt, base) = kvroute_sim::serve::start_in_background_with(profile, SERVERS, 20.0, options).unwrap();
    (rt, (base..base + SERVERS).collect())
}

/// A streamed chat request that does not ask for usage, on a long system prompt shared by
/// every request of the test (later ones find it cached).
fn stream_body(n: usize) -> String {
    let model = Model::Llama31_8b.served_name();
    let system = "a shared system prompt of some length ".repeat(40);
    format!(
        r#"{{"model":"{model}","max_tokens":8,"stream":true,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question {n}"}}]}}"#
    )
}

/// Sends `n` streams that do not ask for usage; returns kvroute's stats after them:
/// (`usage_reported`, `usage_missing`, `tokens.reported_cached`), after checking that the
/// prompt tokens and predictions counted with reports are those of the reporting requests.
fn streams_through_envoy(options: Options, n: usize) -> (u64, u64, u64) {
    let (_rt, ports) = fleet(options);
    let envoy = Envoy::start_workers("envoy.yaml", &ports, 1, |t| t).unwrap();
    envoy.wait_scraped(u64::from(SERVERS));
    for i in 0..n {
        let r = envoy.post("/v1/chat/completions", &[], &stream_body(i)).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    }
    let stat = |name: &str| envoy.stat(&format!("wasmcustom.kvroute.{name}"));
    let all = (stat("tokens.prompt"), stat("tokens.predicted_cached"));
    let reported = (stat("tokens.prompt_reported"), stat("tokens.predicted_cached_reported"));
    assert!(all.0 > 0 && all.1 > 0, "{all:?}");
    match stat("responses.usage_missing") {
        0 => assert_eq!(reported, all, "every answer reported"),
        _ => assert_eq!(reported, (0, 0), "no answer reported"),
    }
    (
        stat("responses.usage_reported"),
        stat("responses.usage_missing"),
        stat("tokens.reported_cached"),
    )
}

#[test]
fn streams_of_servers_forcing_usage_are_read_for_their_cached_tokens() {
    let forced = Options {
        force_include_usage: true,
        ..Options::default()
    };
    let (reported, missing, cached) = streams_through_envoy(forced, 12);
    // The first stream of each server shows it sends usage; every stream is read from then.
    assert_eq!((reported, missing), (12, 0));
    // The shared system prompt was cached after the first request on each server, and the
    // streams' usage said so.
    assert!(cached > 0, "no cached tokens read from the forced usage");

    let (reported, missing, cached) = streams_through_envoy(Options::default(), 12);
    assert_eq!((reported, missing, cached), (0, 12, 0), "a server that sends no usage");
}

#[test]
fn anthropic_answers_report_their_cached_tokens_to_kvroute() {
    let (_rt, ports) = fleet(Options::default());
    let envoy = Envoy::start_workers("envoy.yaml", &ports, 1, |t| t).unwrap();
    envoy.wait_scraped(u64::from(SERVERS));
    let model = Model::Llama31_8b.served_name();
    let system = "an anthropic system prompt of some length ".repeat(40);
    let body = |n: usize, stream: bool| {
        format!(
            r#"{{"model":"{model}","max_tokens":8,"stream":{stream},"system":[{{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.100; cc_entrypoint=cli; cch={n:05x};"}},{{"type":"text","text":"{system}"}}],"messages":[{{"role":"user","content":"question {n}"}}]}}"#
        )
    };
    for n in 0..8 {
        let r = envoy.post("/v1/messages", &[], &body(n, n >= 6)).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.contains("\"input_tokens\""), "{}", r.body);
    }
    let stat = |name: &str| envoy.stat(&format!("wasmcustom.kvroute.{name}"));
    // The first found nothing cached (no cache fields: not a report); the seven after it
    // went to the server holding the system prompt and reported its tokens cached. Each
    // request's attribution block (Claude Code's, a hash new each time) is left out of the
    // prompt by vLLM and of the prefix by kvroute, or none would share it.
    assert_eq!(
        (stat("responses.usage_reported"), stat("responses.usage_missing")),
        (7, 1)
    );
    let cached = stat("tokens.reported_cached");
    assert!(cached >= 7 * 300, "cached tokens read: {cached}");
}
