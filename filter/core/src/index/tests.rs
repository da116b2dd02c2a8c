use super::*;

fn b(n: u64) -> BlockHash {
    BlockHash(n)
}

fn matches(index: &PrefixIndex, blocks: &[BlockHash], slots: usize) -> Vec<u32> {
    let mut out = vec![0; slots];
    index.matches(blocks, &mut out);
    out
}

#[test]
fn matches_count_leading_blocks_per_endpoint() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 100);
    idx.set_capacity(1, 100);
    idx.record(0, &[b(1), b(2), b(3)]);
    idx.record(1, &[b(1), b(9)]);
    assert_eq!(matches(&idx, &[b(1), b(2), b(3), b(4)], 2), vec![3, 1]);
    assert_eq!(
        matches(&idx, &[b(5), b(2)], 2),
        vec![0, 0],
        "a miss on the first block ends the match"
    );
}

#[test]
fn the_tail_of_a_request_is_evicted_before_its_head() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 3);
    idx.record(0, &[b(1), b(2), b(3)]);
    idx.record(0, &[b(7)]);
    assert_eq!(matches(&idx, &[b(1), b(2), b(3)], 1), vec![2]);
    assert_eq!(matches(&idx, &[b(7)], 1), vec![1]);
}

#[test]
fn retouching_a_block_protects_it_from_eviction() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 2);
    idx.record(0, &[b(1)]);
    idx.record(0, &[b(2)]);
    idx.record(0, &[b(1)]);
    idx.record(0, &[b(3)]);
    assert_eq!(matches(&idx, &[b(1)], 1), vec![1]);
    assert_eq!(matches(&idx, &[b(2)], 1), vec![0]);
}

#[test]
fn capacities_are_scaled_to_the_global_budget() {
    let mut idx = PrefixIndex::new(ENTRY_BYTES * 100);
    idx.set_capacity(0, 150);
    idx.set_capacity(1, 50);
    assert_eq!((idx.capacity(0), idx.capacity(1)), (75, 25));
    let blocks: Vec<BlockHash> = (0..500).map(b).collect();
    idx.record(0, &blocks);
    idx.record(1, &blocks);
    assert_eq!(idx.entries(), 100);
}

#[test]
fn removing_an_endpoint_forgets_its_blocks_only() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 10);
    idx.set_capacity(1, 10);
    idx.record(0, &[b(1)]);
    idx.record(1, &[b(1)]);
    idx.remove(0);
    assert_eq!(matches(&idx, &[b(1)], 2), vec![0, 1]);
    assert_eq!(idx.entries(), 1);
    idx.set_capacity(0, 10);
    assert_eq!(matches(&idx, &[b(1)], 2), vec![0, 1], "a reused slot starts empty");
}

#[test]
fn a_zero_capacity_endpoint_records_nothing() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.record(3, &[b(1)]);
    idx.set_capacity(0, 0);
    idx.record(0, &[b(1)]);
    assert_eq!(idx.entries(), 0);
}

#[test]
fn the_lost_share_counts_evicted_blocks_sent_again() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 100);
    idx.set_capacity(1, 100);
    assert_eq!(idx.lost_share(0), None);
    // 150 blocks cycled through a cache of 100: every block sent again was evicted.
    let cycle: Vec<BlockHash> = (0..150).map(b).collect();
    for _ in 0..4 {
        for block in &cycle {
            idx.record(0, &[*block]);
        }
    }
    let lost = idx.lost_share(0).unwrap();
    assert!(lost > 0.9, "{lost}");
    // New blocks only: evictions that never come back.
    for n in 0..1000 {
        idx.record(1, &[b(10_000 + n)]);
    }
    assert_eq!(idx.lost_share(1), Some(0.0));
    assert!((idx.fill(1) - 1.0).abs() < 1e-9 && idx.fill(2) == 0.0);
}

#[test]
fn the_lost_share_is_unknown_until_an_eighth_of_the_cache_was_evicted() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 80);
    idx.record(0, &(0..89).map(b).collect::<Vec<_>>());
    assert_eq!(idx.lost_share(0), None, "9 of 80 evicted");
    idx.record(0, &[b(500)]);
    assert_eq!(idx.lost_share(0), Some(0.0), "10 of 80 evicted");
    assert!((idx.fill(0) - 1.0).abs() < 1e-9);
}

#[test]
fn reuse_depth_tells_reuse_of_the_oldest_content_from_reuse_of_the_newest() {
    let mut idx = PrefixIndex::new(1 << 20);
    idx.set_capacity(0, 1000);
    idx.set_capacity(1, 1000);
    // 40 conversations of 5 blocks each, on both servers.
    let prompt = |c: u64| -> Vec<BlockHash> { (0..5).map(|k| b(c * 100 + k)).collect() };
    for c in 0..40 {
        idx.record(0, &prompt(c));
        idx.record(1, &prompt(c));
    }
    assert_eq!(idx.reuse_depth(0), None, "no prompt came back yet");
    // Server 0: every conversation comes back in turn, the oldest first.
    for c in 0..7 {
        idx.record(0, &prompt(c));
    }
    assert_eq!(idx.reuse_depth(0), None, "7 samples are too few");
    for c in 7..40 {
        idx.record(0, &prompt(c));
    }
    let cyclic = idx.reuse_depth(0).unwrap();
    assert!(cyclic > 0.95, "{cyclic}");
    // Server 1: only the newest conversation comes back; the rest is done.
    for _ in 0..40 {
        idx.record(1, &prompt(39));
    }
    let recent = idx.reuse_depth(1).unwrap();
    assert!(recent < 0.1, "{recent}");
    // A prompt longer than what is held samples where its held part ends.
    let mut longer = prompt(0);
    longer.push(b(99_999));
    idx.record(1, &longer);
    assert!(idx.reuse_depth(1).unwrap() > recent);
}

#[test]
fn projection_counts_live_conversations_at_the_size_conversations_end_at() {
    let mut idx = PrefixIndex::new(1 << 20);
    // Server 1: conversations of 40 blocks go through a cache of 200: their roots are
    // evicted as they end, each a sample of the size conversations end at.
    idx.set_capacity(1, 200);
    let turn = |c: u64, blocks: u64| -> Vec<BlockHash> { (0..blocks).map(|k| b(c * 1000 + k)).collect() };
    for c in 0..20 {
        idx.record(1, &turn(c, 40));
    }
    // Server 0 joins: 10 conversations of 10 blocks, then three rounds of their next turn
    // (12 blocks), each conversation in turn.
    idx.set_capacity(0, 1000);
    for c in 100..110 {
        idx.record(0, &turn(c, 10));
    }
    assert_eq!(idx.projected_held(0), None, "no reuse depth yet");
    for _ in 0..3 {
        for c in 100..110 {
            idx.record(0, &turn(c, 12));
        }
    }
    let held = idx.held(0) as f64;
    let projected = idx.projected_held(0).expect("8 roots ended, a depth, 16 records");
    // Its ten live conversations of 12 blocks, each projected at the 40 that ended elsewhere.
    assert!(projected == 400.0, "{projected}");
    assert!(held <= 120.0 && projected > 2.5 * held, "{held}");
    // Prompts under Root::MIN_BLOCKS get no root.
    let mut short = PrefixIndex::new(1 << 20);
    short.set_capacity(0, 50);
    for c in 0..100 {
        short.record(0, &turn(c, 7));
    }
    assert_eq!(short.ended.get(), None);
}
