//! The core compiled to wasm32 gives exactly the native results: the same golden prefix
//! hashes and, under every policy, the same decisions in the scripted scenario.
#![cfg(target_arch = "wasm32")]

use kvroute_core::scenario::{check_golden_vectors, scripted_routing_all_policies};
use kvroute_core::{parse_metrics, Config};
use wasm_bindgen_test::wasm_bindgen_test;

const GOLDEN: &str = include_str!("../../filter/core/tests/fixtures/prefix_hash_golden.json");
const SCENARIO: &str = include_str!("../../filter/core/tests/fixtures/scenario_expected.txt");
const METRICS: &str = include_str!("../../filter/core/tests/fixtures/vllm_metrics_v0.33.txt");

#[wasm_bindgen_test]
fn golden_prefix_hashes_match_on_wasm() {
    let checked = check_golden_vectors(GOLDEN).unwrap();
    assert!(checked > 20);
}

#[wasm_bindgen_test]
fn scripted_routing_matches_native_decisions_on_wasm() {
    assert_eq!(scripted_routing_all_policies().unwrap(), SCENARIO);
}

#[wasm_bindgen_test]
fn reference_metrics_parse_on_wasm() {
    let m = parse_metrics(METRICS.as_bytes(), 1 << 20).unwrap();
    assert_eq!((m.running, m.waiting, m.num_gpu_blocks), (12, 3, Some(29_205)));
}

#[wasm_bindgen_test]
fn config_errors_are_the_same_on_wasm() {
    let err = Config::from_json(br#"{"scrape": {"interval_ms": 200, "timeout_ms": 500}}"#).unwrap_err();
    assert_eq!(err.field, "scrape.timeout_ms");
}
