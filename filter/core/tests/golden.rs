//! The native build against the golden fixtures (the wasm suite checks the same files).

use kvroute_core::scenario::{check_golden_vectors, scripted_routing_all_policies};

const GOLDEN: &str = include_str!("fixtures/prefix_hash_golden.json");
const SCENARIO: &str = include_str!("fixtures/scenario_expected.txt");

#[test]
fn prefix_hashes_match_the_independent_python_implementation() {
    let checked = check_golden_vectors(GOLDEN).unwrap();
    assert!(checked > 20, "only {checked} hashes checked");
}

#[test]
fn scripted_routing_matches_the_recorded_decisions() {
    let got = scripted_routing_all_policies().unwrap();
    if std::env::var_os("KVROUTE_BLESS").is_some() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/scenario_expected.txt");
        std::fs::write(path, &got).unwrap();
        return;
    }
    assert_eq!(
        got, SCENARIO,
        "decisions changed: review, then re-record with KVROUTE_BLESS=1"
    );
}

#[test]
fn the_scenario_exercises_every_outcome_it_should() {
    for label in ["prefix_hit", "cold"] {
        assert!(SCENARIO.contains(label), "{label} missing from the scenario");
    }
    assert!(!SCENARIO.contains("fallback_no_endpoints"));
}
