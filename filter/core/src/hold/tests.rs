use super::*;

fn drain<T: Clone>(q: &mut HoldQueue<T>, n: usize) -> Vec<T> {
    (0..n).filter_map(|_| q.pop().map(|h| h.item)).collect()
}

#[test]
fn one_flow_is_first_in_first_out() {
    let mut q = HoldQueue::new(16, 4.0);
    for i in 0..5 {
        assert_eq!(q.push(i, 0, "a", Millis(i)), Admit::Held);
    }
    assert_eq!(q.len(), 5);
    assert_eq!(drain(&mut q, 10), vec![0, 1, 2, 3, 4]);
    assert!(q.is_empty());
}

#[test]
fn a_heavy_tenant_does_not_delay_a_light_one_behind_its_backlog() {
    let mut q = HoldQueue::new(1000, 4.0);
    for i in 0..100 {
        q.push(("heavy", i), 0, "heavy", Millis(0));
    }
    q.push(("light", 0), 0, "light", Millis(1));
    q.push(("light", 1), 0, "light", Millis(1));
    let first: Vec<_> = drain(&mut q, 4);
    assert_eq!(
        first.iter().filter(|(t, _)| *t == "light").count(),
        2,
        "the light tenant's two requests go out among the first four: {first:?}"
    );
}

#[test]
fn a_higher_band_gets_its_weight_in_dispatches_and_the_lower_band_still_moves() {
    let mut q = HoldQueue::new(1000, 4.0);
    for i in 0..200 {
        q.push((1, i), 1, "t", Millis(0));
        q.push((0, i), 0, "t", Millis(0));
    }
    let out = drain(&mut q, 100);
    let high = out.iter().filter(|(p, _)| *p == 1).count();
    let low = out.len() - high;
    assert!((78..=82).contains(&high), "4:1 while both wait: {high} vs {low}");
    assert!(low >= 18, "the low band is not starved: {low}");
}

#[test]
fn an_idle_flow_banks_no_credit() {
    let mut q = HoldQueue::new(1000, 4.0);
    for i in 0..50 {
        q.push(("busy", i), 0, "busy", Millis(0));
    }
    drain(&mut q, 40);
    for i in 0..10 {
        q.push(("late", i), 0, "late", Millis(5));
    }
    let out = drain(&mut q, 10);
    let late = out.iter().filter(|(t, _)| *t == "late").count();
    assert!(
        (4..=6).contains(&late),
        "a tenant that arrives later shares from then on, it does not take everything: {out:?}"
    );
}

#[test]
fn a_full_queue_displaces_the_newest_of_a_lower_priority_and_refuses_otherwise() {
    let mut q = HoldQueue::new(3, 4.0);
    q.push("low-old", 0, "a", Millis(0));
    q.push("low-new", 0, "a", Millis(1));
    q.push("high", 2, "b", Millis(2));
    assert_eq!(q.push("low-refused", 0, "c", Millis(3)), Admit::Refused("low-refused"));
    match q.push("higher", 1, "c", Millis(4)) {
        Admit::Displaced(h) => assert_eq!(h.item, "low-new"),
        other => panic!("expected a displacement, got {other:?}"),
    }
    assert_eq!(q.len(), 3);
    let mut out = drain(&mut q, 3);
    out.sort();
    assert_eq!(out, vec!["high", "higher", "low-old"]);
}

#[test]
fn requests_past_the_wait_bound_expire_and_the_rest_stay_in_order() {
    let mut q = HoldQueue::new(16, 4.0);
    q.push(0, 0, "a", Millis(100));
    q.push(1, 0, "a", Millis(200));
    q.push(2, 0, "b", Millis(300));
    let gone: Vec<_> = q.expire(Millis(1200), |_| 1000).into_iter().map(|h| h.item).collect();
    assert_eq!(gone, vec![0, 1]);
    assert_eq!(q.len(), 1);
    assert_eq!(q.peek().map(|h| h.item), Some(2));
    assert!(q.expire(Millis(1299), |_| 1000).is_empty());
}

#[test]
fn each_request_expires_at_its_own_bound() {
    let mut q = HoldQueue::new(16, 4.0);
    // The item is its bound: a short objective's request goes first though held last.
    q.push(5000, 0, "a", Millis(0));
    q.push(300, 0, "a", Millis(100));
    q.push(2000, 0, "b", Millis(100));
    let at = |q: &mut HoldQueue<u64>, now| -> Vec<u64> {
        q.expire(Millis(now), |b| *b).into_iter().map(|h| h.item).collect()
    };
    assert!(at(&mut q, 399).is_empty());
    assert_eq!(at(&mut q, 400), vec![300]);
    assert_eq!(at(&mut q, 2099), Vec::<u64>::new());
    assert_eq!(at(&mut q, 2100), vec![2000]);
    assert_eq!(q.peek().map(|h| h.item), Some(5000));
}

#[test]
fn a_client_that_hangs_up_leaves_the_queue() {
    let mut q = HoldQueue::new(16, 4.0);
    for i in 0..4 {
        q.push(i, 0, "a", Millis(0));
    }
    let gone = q.remove_where(|h| h.item == 2);
    assert_eq!(gone.len(), 1);
    assert_eq!(drain(&mut q, 10), vec![0, 1, 3]);
}

#[test]
fn peek_names_what_pop_takes() {
    let mut q = HoldQueue::new(16, 2.0);
    q.push("a0", 0, "a", Millis(0));
    q.push("b1", 1, "b", Millis(0));
    q.push("a1", 0, "a", Millis(0));
    while let Some(next) = q.peek().map(|h| h.item) {
        assert_eq!(q.pop().map(|h| h.item), Some(next));
    }
}

#[test]
fn a_queue_that_round_trips_through_bytes_keeps_its_order_and_its_fairness_state() {
    let mut q = HoldQueue::new(64, 4.0);
    for i in 0..6u64 {
        q.push(i, 0, "a", Millis(i));
    }
    q.push(100, 1, "b", Millis(7));
    drain(&mut q, 2);
    let mut bytes = Vec::new();
    q.encode(&mut bytes, |i, out| out.extend(i.to_le_bytes()));
    bytes.extend(b"tail");
    let mut rest = bytes.as_slice();
    let mut back = HoldQueue::decode(&mut rest, 64, 4.0, |b| take::<8>(b).map(u64::from_le_bytes)).unwrap();
    assert_eq!(rest, b"tail", "decode takes exactly what encode wrote");
    assert_eq!(back.len(), q.len());
    back.push(9, 0, "c", Millis(8));
    q.push(9, 0, "c", Millis(8));
    assert_eq!(
        drain(&mut back, 10),
        drain(&mut q, 10),
        "the same pops after a round trip, a new tenant included"
    );
    for cut in 0..bytes.len() - 4 {
        let mut short = &bytes[..cut];
        let r = HoldQueue::decode(&mut short, 64, 4.0, |b| take::<8>(b).map(u64::from_le_bytes));
        assert!(r.is_none(), "{cut} bytes of {} are no queue", bytes.len() - 4);
    }
}

#[test]
fn iter_sees_every_held_request_and_limits_follow_the_configuration() {
    let mut q = HoldQueue::new(2, 4.0);
    q.push(1, 0, "a", Millis(0));
    q.push(2, 1, "b", Millis(0));
    let mut all: Vec<_> = q.iter().map(|h| h.item).collect();
    all.sort();
    assert_eq!(all, vec![1, 2]);
    assert_eq!(q.push(3, 0, "c", Millis(1)), Admit::Refused(3));
    q.set_limits(3, 4.0);
    assert_eq!(q.push(3, 0, "c", Millis(1)), Admit::Held);
}

#[test]
fn taking_the_head_by_name_is_a_pop_and_a_later_request_can_be_taken_too() {
    let mut a = HoldQueue::new(64, 4.0);
    let mut b = HoldQueue::new(64, 4.0);
    for q in [&mut a, &mut b] {
        for i in 0..4 {
            q.push(i, 0, "x", Millis(0));
        }
        q.push(10, 0, "y", Millis(0));
    }
    let head = a.peek().map(|h| h.item);
    assert_eq!(a.take(|i| Some(*i) == head).map(|h| h.item), b.pop().map(|h| h.item));
    // A new tenant then starts where virtual time is: the same order either way.
    a.push(20, 0, "z", Millis(1));
    b.push(20, 0, "z", Millis(1));
    assert_eq!(drain(&mut a, 10), drain(&mut b, 10));
    assert_eq!(a.take(|_| true), None);
    a.push(1, 0, "x", Millis(2));
    a.push(2, 0, "x", Millis(2));
    assert_eq!(a.take(|i| *i == 2).map(|h| h.item), Some(2));
    assert_eq!(drain(&mut a, 10), vec![1]);
}

#[test]
fn bytes_with_one_flow_twice_are_no_queue() {
    let mut q = HoldQueue::new(8, 4.0);
    q.push(1u64, 0, "a", Millis(0));
    let mut one = Vec::new();
    q.encode(&mut one, |i, out| out.extend(i.to_le_bytes()));
    // The same flow written twice under a count of 2.
    let flow = &one[12..];
    let mut twice = one[..8].to_vec();
    twice.extend(2u32.to_le_bytes());
    twice.extend(flow);
    twice.extend(flow);
    let mut b = twice.as_slice();
    assert!(HoldQueue::decode(&mut b, 8, 4.0, |b| take::<8>(b).map(u64::from_le_bytes)).is_none());
}

#[test]
fn past_the_threshold_a_flow_serves_its_newest_first_and_keeps_its_share() {
    let mut q = HoldQueue::new(64, 4.0);
    q.set_newest_first(500);
    for i in 0..4u64 {
        q.push(("a", i), 0, "a", Millis(i * 100));
        q.push(("b", i), 0, "b", Millis(i * 100));
    }
    q.set_now(Millis(400));
    assert_eq!(
        q.peek().map(|h| h.item),
        Some(("a", 0)),
        "nobody waited 500 ms: oldest first"
    );
    q.set_now(Millis(600));
    // Flows "a" and "b" still alternate (fair shares unchanged); within each, the newest goes.
    let out = drain(&mut q, 4);
    assert_eq!(out, vec![("a", 3), ("b", 3), ("a", 2), ("b", 2)]);
    // Past the threshold no longer (the late ones left): oldest first again.
    let mut q2 = HoldQueue::new(64, 4.0);
    q2.set_newest_first(500);
    q2.push(1, 0, "a", Millis(1000));
    q2.push(2, 0, "a", Millis(1200));
    q2.set_now(Millis(1300));
    assert_eq!(drain(&mut q2, 2), vec![1, 2]);
}

#[test]
fn tenants_and_priorities_that_come_and_go_leave_a_bounded_board() {
    // Clients that name a new tenant or priority each time and hang up while held (or
    // expire): their empty flows keep a finish tag ahead of a virtual time that only a
    // release moves, so without a bound the board (decoded and written by every worker at
    // every tick) would grow with every name ever held.
    let mut q = HoldQueue::new(8, 4.0);
    for i in 0..2_000i64 {
        q.push(i, i * 7_919 - 1_000_000, &format!("tenant-{i}"), Millis(0));
        q.remove_where(|_| true);
    }
    assert!(q.is_empty());
    assert!(q.flows.len() <= 2 * 8, "{} flows kept", q.flows.len());
    // Priorities past ±MAX_PRIORITY weigh as ±MAX_PRIORITY, and share its flows.
    q.push(1, 1_000, "t", Millis(0));
    q.push(2, 9, "t", Millis(0));
    assert_eq!(
        q.flows.keys().filter(|(p, t)| *p == MAX_PRIORITY && t == "t").count(),
        1
    );
}

#[test]
fn the_head_of_a_subset_is_its_first_request_in_the_queues_order() {
    // Items: (model, n). Tenant "a" holds two requests of model 0 then one of model 1;
    // tenant "b" one of model 1, later.
    let mut q = HoldQueue::new(16, 4.0);
    q.push((0, 1), 0, "a", Millis(0));
    q.push((0, 2), 0, "a", Millis(0));
    q.push((1, 3), 0, "a", Millis(0));
    q.push((1, 4), 0, "b", Millis(1));
    let all = |_: &(u8, u8)| true;
    assert_eq!(q.peek_where(all).map(|h| h.item), q.peek().map(|h| h.item));
    // Model 1's head: tenant a's slot comes first (its front's start tag), and within the
    // flow model 1's first request.
    let model_1 = |i: &(u8, u8)| i.0 == 1;
    assert_eq!(q.peek_where(model_1).map(|h| h.item), Some((1, 3)));
    assert_eq!(q.peek_where(|i| i.0 == 2), None);
    // Taken in that place, the flow's order is kept for the rest.
    assert_eq!(q.take(|i| *i == (1, 3)).map(|h| h.item), Some((1, 3)));
    assert_eq!(q.peek_where(model_1).map(|h| h.item), Some((1, 4)));
    assert_eq!(drain(&mut q, 10), vec![(1, 4), (0, 1), (0, 2)]);
}

#[test]
fn a_flow_serving_its_newest_first_does_so_within_a_subset_too() {
    let mut q = HoldQueue::new(16, 4.0);
    q.set_newest_first(100);
    q.push((1, 1), 0, "a", Millis(0));
    q.push((1, 2), 0, "a", Millis(0));
    q.push((0, 3), 0, "a", Millis(0));
    q.set_now(Millis(500));
    assert_eq!(q.peek().map(|h| h.item), Some((0, 3)));
    assert_eq!(
        q.peek_where(|i| i.0 == 1).map(|h| h.item),
        Some((1, 2)),
        "the newest of the subset"
    );
}
