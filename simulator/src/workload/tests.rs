use std::collections::HashMap;

use super::*;
use crate::profile::{Gpu, Model, Profile, BLOCK_TOKENS};

#[test]
fn mooncake_lines_expand_to_512_token_blocks_with_a_partial_last_one() {
    let reqs =
        parse_mooncake("{\"timestamp\": 5, \"input_length\": 1100, \"output_length\": 3, \"hash_ids\": [1, 2, 3]}\n")
            .unwrap();
    assert_eq!(reqs[0].input_tokens(), 1100);
    assert_eq!(
        reqs[0].segments.iter().map(|s| s.tokens).collect::<Vec<_>>(),
        vec![512, 512, 76]
    );
    assert_eq!(reqs[0].prompt_text().len(), 4400);
}

#[test]
fn mooncake_requests_sharing_hash_ids_share_text() {
    let reqs = parse_mooncake(
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [7, 8]}\n{\"timestamp\": 1, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [7, 9]}",
    )
    .unwrap();
    let (a, b) = (reqs[0].prompt_text(), reqs[1].prompt_text());
    assert_eq!(a[..2048], b[..2048]);
    assert_ne!(a[2048..], b[2048..]);
}

#[test]
fn malformed_trace_lines_are_rejected_with_their_line_number() {
    let err =
        parse_mooncake("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{oops}\n")
            .unwrap_err();
    assert!(format!("{err:#}").contains("line 2"), "{err:#}");
    let err = parse_mooncake("{\"timestamp\": 0, \"input_length\": 2000, \"output_length\": 1, \"hash_ids\": [1]}")
        .unwrap_err();
    assert!(format!("{err:#}").contains("line 1"), "{err:#}");
    let err = parse_azure(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12\n",
        0,
        0,
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("line 2"), "{err:#}");
}

#[test]
fn azure_timestamps_become_relative_ms_and_the_overlay_shares_half_the_context() {
    let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:59:59.5000000,1000,10\n2023-11-17 00:00:01.0000000,1000,20\n";
    let plain = parse_azure(csv, 0, 0).unwrap();
    assert_eq!(plain[1].arrival_ms, 1500.0);
    assert_eq!(plain[1].output_tokens, 20);
    let overlaid = parse_azure(csv, 1, 0).unwrap();
    let (a, b) = (overlaid[0].prompt_text(), overlaid[1].prompt_text());
    assert_eq!(
        a[..448 * 4],
        b[..448 * 4],
        "448 of 1000 tokens (half, in 64-token steps) shared"
    );
    assert_ne!(a[448 * 4..], b[448 * 4..]);
}

#[test]
fn shared_prefix_defaults_make_1024_requests_in_64_groups() {
    let reqs = generate(Generator::SharedPrefix, &GenParams::defaults(Generator::SharedPrefix));
    assert_eq!(reqs.len(), 1024);
    assert!(reqs.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
    assert!(reqs
        .iter()
        .all(|r| r.input_tokens() == 2048 + 128 && r.output_tokens == 256));
    let systems: std::collections::BTreeSet<u64> = reqs.iter().map(|r| r.segments[0].seed).collect();
    assert_eq!(systems.len(), 64);
}

#[test]
fn multi_turn_prompts_extend_their_history() {
    let reqs = generate(Generator::MultiTurn, &GenParams::defaults(Generator::MultiTurn));
    let first_conv: Vec<&SimRequest> = reqs.iter().filter(|r| r.segments[0] == reqs[0].segments[0]).collect();
    assert_eq!(first_conv.len(), 6);
    for w in first_conv.windows(2) {
        assert!(w[1].segments.starts_with(&w[0].segments));
    }
}

#[test]
fn long_chat_histories_outgrow_one_servers_cache() {
    let reqs = generate(Generator::MultiTurn, &GenParams::long_chat());
    assert_eq!(reqs.len(), 1024 * 8);
    // The last turn carries the system prompt, 8 user turns and the 7 replies before it.
    let longest = reqs.iter().map(SimRequest::input_tokens).max().unwrap();
    assert_eq!(longest, 1000 + 8 * 200 + 7 * 200);
    // The history open at each arrival: per conversation (its own system prompt), the
    // prompt of its latest turn so far, until its last turn. At the peak it is several
    // times one server's KV cache and less than eight servers' (simulator/README.md).
    let mut last_turn: HashMap<u64, f64> = HashMap::new();
    for r in &reqs {
        let e = last_turn.entry(r.segments[0].seed).or_insert(0.0);
        *e = e.max(r.arrival_ms);
    }
    assert_eq!(last_turn.len(), 1024);
    let mut open: HashMap<u64, u64> = HashMap::new();
    let mut peak = 0;
    for r in &reqs {
        let conversation = r.segments[0].seed;
        open.insert(conversation, r.input_tokens());
        open.retain(|c, _| last_turn[c] >= r.arrival_ms);
        peak = peak.max(open.values().sum::<u64>());
    }
    let cache = Profile::new(Gpu::H100_80g, Model::Llama31_8b, 1)
        .unwrap()
        .num_gpu_blocks
        * BLOCK_TOKENS;
    assert!(
        peak > 5 * cache && peak < 8 * cache,
        "peak {peak} tokens against {cache}"
    );
}

#[test]
fn generators_are_deterministic_per_seed() {
    let p = GenParams::defaults(Generator::Rag);
    assert_eq!(generate(Generator::Rag, &p), generate(Generator::Rag, &p));
    let other = GenParams { seed: 1, ..p.clone() };
    assert_ne!(generate(Generator::Rag, &p), generate(Generator::Rag, &other));
}

#[test]
fn out_of_range_timestamps_are_errors_not_overflows() {
    // Found by the `traces` fuzz target (an integer overflow on an absurd date).
    let crash = include_bytes!("../../tests/fixtures/fuzz-azure-timestamp-overflow.csv");
    let _ = parse_azure(&String::from_utf8_lossy(crash), 4, 0);
    for bad in [
        "99999999999999-01-01 00:00:00",
        "2023-13-01 00:00:00",
        "2023-01-01 25:00:00",
        "-5-01-01 00:00:00",
    ] {
        let err = parse_azure(&format!("TIMESTAMP,ContextTokens,GeneratedTokens\n{bad},10,1\n"), 0, 0).unwrap_err();
        assert!(format!("{err:#}").contains("line 2"), "{bad}: {err:#}");
    }
}

#[test]
fn capture_lines_replay_in_arrival_order_with_shared_blocks_and_a_tail_of_their_own() {
    let text = concat!(
        r#"{"timestamp":1000050,"model":"m","input_length":150,"output_length":4,"usage":true,"hash_ids":[11,12],"block_tokens":64,"server":"a:1","cached_tokens":128,"status":200}"#,
        "\n",
        r#"{"timestamp":1000000,"model":"m","input_length":100,"output_length":0,"usage":false,"hash_ids":[11],"block_tokens":64,"server":null,"cached_tokens":null,"status":0}"#,
        "\n",
        r#"{"timestamp":1000070,"model":"m","input_length":64,"output_length":9,"usage":true,"hash_ids":[11],"block_tokens":64,"server":"a:1","cached_tokens":null,"status":400}"#,
        "\n",
        r#"{"timestamp":1000090,"model":"m","input_length":64,"output_length":0,"usage":false,"hash_ids":[11],"block_tokens":64,"server":null,"cached_tokens":null,"status":429}"#,
        "\n",
    );
    let (reqs, notes) = parse_capture(text, 77).unwrap();
    assert_eq!(reqs.len(), 3, "the 400 was never generated; the shed 429 is demand");
    assert_eq!((notes.lines, notes.client_errors, notes.estimated), (4, 1, 2));
    assert_eq!(notes.live_hit_rate(), Some(128.0 / 150.0));
    let (first, second) = (&reqs[0], &reqs[1]);
    assert_eq!((first.arrival_ms, second.arrival_ms), (0.0, 50.0));
    assert_eq!(
        first.output_tokens, 77,
        "no usage and no max_tokens: the stated default"
    );
    assert_eq!((first.input_tokens(), second.input_tokens()), (100, 150));
    assert_eq!(first.segments[0], second.segments[0], "hash id 11 is the same text");
    assert_eq!(second.segments[1].tokens, 64);
    assert_eq!(second.segments[2].tokens, 22, "the prompt past the ids");
    assert_ne!(
        first.segments[1].seed, second.segments[2].seed,
        "tails are never shared"
    );
}

#[test]
fn a_capture_line_without_block_tokens_is_refused_with_its_line() {
    let err = parse_capture(r#"{"timestamp":0,"input_length":1,"output_length":1,"hash_ids":[]}"#, 1).unwrap_err();
    assert!(format!("{err:#}").contains("capture line 1"), "{err:#}");
}

#[test]
fn a_longer_rag_trace_extends_the_default_one_over_the_same_documents() {
    let p = GenParams::defaults(Generator::Rag);
    let short = generate(Generator::Rag, &p);
    let long = generate(
        Generator::Rag,
        &GenParams {
            queries: Some(3 * short.len() as u64),
            ..p.clone()
        },
    );
    assert_eq!(short.len(), 8 * p.groups as usize);
    assert_eq!(long.len(), 3 * short.len());
    assert_eq!(&long[..short.len()], &short[..]);
    let docs = |reqs: &[SimRequest]| {
        let mut ids: Vec<u64> = reqs
            .iter()
            .flat_map(|r| r.segments[1..=3].iter().map(|s| s.seed))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    };
    assert!(
        docs(&long) <= p.groups as usize,
        "only the {} documents are drawn",
        p.groups
    );
}
