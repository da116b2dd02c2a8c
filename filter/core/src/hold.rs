//! Holding requests at the gateway while every server is full (`overload.hold`).
//!
//! A held request waits in one flow per (priority, tenant). Flows are served by start-time
//! fair queueing (Goyal, Vin and Cheng, "Start-time Fair Queuing", SIGCOMM 1996): each
//! request of a flow is stamped with a virtual start `max(V, finish of the flow's previous
//! request)` and a finish `start + 1 / weight`; the next request out is the head with the
//! smallest start tag, and `V` becomes that tag. A flow of weight `w` gets `w` times the
//! dispatches of a flow of weight 1 while both wait, and a flow that was idle cannot bank
//! credit (its first tag is `V`), so no tenant and no priority band starves: every waiting
//! flow moves at a rate proportional to its weight. The weight of priority `p` is
//! `priority_weight^p` (`p` clamped to `±MAX_PRIORITY`): one band up is worth
//! `priority_weight` times the dispatches; tenants of one band share equally. Sheddable
//! requests (negative priority) wait too, at a fraction of the weight, and are the first
//! displaced when the queue is full.
//!
//! The queue is bounded twice: by `max_requests` (an arrival finds it full: it displaces the
//! newest request of the lowest priority held when that priority is lower than its own,
//! otherwise it is refused) and by each request's wait bound (`expire`: `max_wait_ms`, or its
//! share of the request's own TTFT objective). Either way the caller answers
//! 429 with `Retry-After`. What decides that a server has room is the router's
//! (`Router::route` returns `Outcome::Hold` while none has); this file only orders.

use std::collections::{BTreeMap, VecDeque};

use crate::types::Millis;

/// Priorities beyond ±this weigh as ±this (weights stay finite and ordered).
pub const MAX_PRIORITY: i64 = 8;

/// One held request.
#[derive(Clone, Debug, PartialEq)]
pub struct Held<T> {
    pub item: T,
    pub priority: i64,
    pub since: Millis,
    start: f64,
}

/// What became of an arrival offered to the queue.
#[derive(Debug, PartialEq)]
pub enum Admit<T> {
    Held,
    /// Held, and this lower-priority request left the queue to make room: answer it 429.
    Displaced(Held<T>),
    /// The queue is full of requests at least as important: answer the arrival 429.
    Refused(T),
}

#[derive(Debug)]
struct Flow<T> {
    queue: VecDeque<Held<T>>,
    /// Virtual finish of the flow's last stamped request.
    finish: f64,
}

/// The held requests of one router (or of one Envoy process: the filter keeps it in shared
/// data, `encode` / `decode`), in fair order.
#[derive(Debug)]
pub struct HoldQueue<T> {
    /// Keyed by (priority, tenant).
    flows: BTreeMap<(i64, String), Flow<T>>,
    /// Virtual time: the start tag of the last request out.
    now_v: f64,
    len: usize,
    max_requests: usize,
    priority_weight: f64,
    /// Within a flow, the newest request goes out first once the oldest has waited this
    /// long (0: first come, first served).
    newest_first_after_ms: u64,
    /// The time of the last `set_now` or `expire`.
    now: Millis,
}

impl<T> HoldQueue<T> {
    pub fn new(max_requests: usize, priority_weight: f64) -> HoldQueue<T> {
        HoldQueue {
            flows: BTreeMap::new(),
            now_v: 0.0,
            len: 0,
            max_requests: max_requests.max(1),
            priority_weight: priority_weight.max(1.0),
            newest_first_after_ms: 0,
            now: Millis(0),
        }
    }

    /// Within a flow, the newest request goes out first once the oldest has waited
    /// `after_ms` (0: never). Under sustained overload the oldest would mostly miss their
    /// objective anyway; they leave at the wait bound instead.
    pub fn set_newest_first(&mut self, after_ms: u64) {
        self.newest_first_after_ms = after_ms;
    }

    /// The time the order is judged at (`newest_first`).
    pub fn set_now(&mut self, now: Millis) {
        self.now = now;
    }

    /// Which of a flow's requests goes out when the flow is served.
    fn index_out(&self, flow: &Flow<T>) -> usize {
        let late =
            |h: &Held<T>| self.newest_first_after_ms > 0 && self.now.since(h.since) >= self.newest_first_after_ms;
        match flow.queue.front() {
            Some(h) if late(h) => flow.queue.len() - 1,
            _ => 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Takes the bounds of the configuration in force (a queue kept across a configuration
    /// change keeps its requests and their order).
    pub fn set_limits(&mut self, max_requests: usize, priority_weight: f64) {
        self.max_requests = max_requests.max(1);
        self.priority_weight = priority_weight.max(1.0);
    }

    /// Every held request, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Held<T>> {
        self.flows.values().flat_map(|f| f.queue.iter())
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn weight(&self, priority: i64) -> f64 {
        self.priority_weight
            .powi(priority.clamp(-MAX_PRIORITY, MAX_PRIORITY) as i32)
    }

    /// Offers an arrival; see `Admit`.
    pub fn push(&mut self, item: T, priority: i64, tenant: &str, since: Millis) -> Admit<T> {
        // Beyond ±MAX_PRIORITY a band weighs no more: it is that band (and a client naming
        // a new priority each time adds no flow).
        let priority = priority.clamp(-MAX_PRIORITY, MAX_PRIORITY);
        let mut displaced = None;
        if self.len >= self.max_requests {
            match self.lowest_priority() {
                Some(low) if low < priority => displaced = self.pop_newest_of(low),
                _ => return Admit::Refused(item),
            }
        }
        let step = 1.0 / self.weight(priority);
        let now_v = self.now_v;
        let flow = self.flows.entry((priority, tenant.to_string())).or_insert(Flow {
            queue: VecDeque::new(),
            finish: now_v,
        });
        let start = flow.finish.max(now_v);
        flow.finish = start + step;
        flow.queue.push_back(Held {
            item,
            priority,
            since,
            start,
        });
        self.len += 1;
        self.trim_idle();
        match displaced {
            Some(d) => Admit::Displaced(d),
            None => Admit::Held,
        }
    }

    /// The flow whose head goes out next: the smallest start tag, ties to the higher
    /// priority, then the tenant's name (deterministic).
    fn next_key(&self) -> Option<(i64, String)> {
        self.next_where(|_| true).map(|(k, _)| k.clone())
    }

    /// Among the requests `keep` picks, the one that goes out next and its flow: each flow
    /// offers the request it would send (`index_out`) when `keep` picks it, else its first
    /// one `keep` picks, at the flow's next slot (`take_at`); the smallest slot wins, as in
    /// `next_key`.
    fn next_where(&self, keep: impl Fn(&T) -> bool) -> Option<(&(i64, String), &Held<T>)> {
        self.flows
            .iter()
            .filter_map(|(k, f)| {
                let slot = f.queue.front()?.start;
                let at = self.index_out(f);
                let out = f.queue.get(at).filter(|h| keep(&h.item));
                // A flow serving its newest first keeps that order among those picked.
                let held = out.or_else(|| match at {
                    0 => f.queue.iter().find(|h| keep(&h.item)),
                    _ => f.queue.iter().rfind(|h| keep(&h.item)),
                })?;
                Some((slot, k, held))
            })
            .min_by(|(a, ka, _), (b, kb, _)| a.total_cmp(b).then(kb.0.cmp(&ka.0)).then(ka.1.cmp(&kb.1)))
            .map(|(_, k, h)| (k, h))
    }

    /// The request that goes out next, without taking it.
    pub fn peek(&self) -> Option<&Held<T>> {
        let key = self.next_key()?;
        let flow = self.flows.get(&key)?;
        flow.queue.get(self.index_out(flow))
    }

    /// The request that would go out next if the queue held only those `keep` picks (the
    /// head of one model's requests, where requests of several wait in one queue), without
    /// taking it; `take` takes it in that place.
    pub fn peek_where(&self, keep: impl Fn(&T) -> bool) -> Option<&Held<T>> {
        self.next_where(keep).map(|(_, h)| h)
    }

    /// Takes the request that goes out next.
    pub fn pop(&mut self) -> Option<Held<T>> {
        let key = self.next_key()?;
        let at = self.index_out(self.flows.get(&key)?);
        self.take_at(&key, at)
    }

    /// Takes the first request `which` names as if it went out next: a request released
    /// by one holder while others may have changed the queue since.
    pub fn take(&mut self, mut which: impl FnMut(&T) -> bool) -> Option<Held<T>> {
        let (key, at) = self
            .flows
            .iter()
            .find_map(|(k, f)| f.queue.iter().position(|h| which(&h.item)).map(|i| (k.clone(), i)))?;
        self.take_at(&key, at)
    }

    /// Takes request `at` of a flow in the flow's next slot: it leaves with the front's
    /// start tag (virtual time moves to it), and the requests before it move up one slot.
    fn take_at(&mut self, key: &(i64, String), at: usize) -> Option<Held<T>> {
        let flow = self.flows.get_mut(key)?;
        if at >= flow.queue.len() {
            return None;
        }
        let slot = flow.queue.front()?.start;
        for i in 0..at {
            let next = flow.queue[i + 1].start;
            flow.queue[i].start = next;
        }
        let mut held = flow.queue.remove(at)?;
        held.start = slot;
        self.len -= 1;
        self.now_v = self.now_v.max(slot);
        // An empty flow's finish tag still bounds its next start while it stays ahead of
        // `now_v`; once `now_v` passes it, the entry carries nothing and goes.
        if flow.queue.is_empty() && flow.finish <= self.now_v {
            self.flows.remove(key);
        }
        Some(held)
    }

    fn lowest_priority(&self) -> Option<i64> {
        self.flows
            .iter()
            .filter(|(_, f)| !f.queue.is_empty())
            .map(|(k, _)| k.0)
            .min()
    }

    /// The most recently held request of priority `priority` (of the tenant with the
    /// longest queue there: the one taking most of the room).
    fn pop_newest_of(&mut self, priority: i64) -> Option<Held<T>> {
        let key = self
            .flows
            .iter()
            .filter(|(k, f)| k.0 == priority && !f.queue.is_empty())
            .max_by_key(|(_, f)| f.queue.len())
            .map(|(k, _)| k.clone())?;
        let flow = self.flows.get_mut(&key)?;
        let held = flow.queue.pop_back()?;
        // Its slot in the flow's schedule is given back.
        flow.finish = held.start;
        self.len -= 1;
        Some(held)
    }

    /// Takes every request held as long as its bound (`bound`: each request's own, see
    /// `RawHold::wait_bound_ms`) or longer at `now`.
    pub fn expire(&mut self, now: Millis, bound: impl Fn(&T) -> u64) -> Vec<Held<T>> {
        self.now = now;
        self.remove_where(|h| now.since(h.since) >= bound(&h.item))
    }

    /// Takes every request `gone` says left (a client that hung up while held).
    pub fn remove_where(&mut self, mut gone: impl FnMut(&Held<T>) -> bool) -> Vec<Held<T>> {
        let mut out = Vec::new();
        for flow in self.flows.values_mut() {
            let (keep, leave): (VecDeque<_>, VecDeque<_>) = flow.queue.drain(..).partition(|h| !gone(h));
            flow.queue = keep;
            out.extend(leave);
        }
        self.len -= out.len();
        let now_v = self.now_v;
        self.flows.retain(|_, f| !f.queue.is_empty() || f.finish > now_v);
        self.trim_idle();
        out
    }

    /// Keeps at most `max_requests` empty flows, those whose finish tag is furthest ahead
    /// (the ones that were served most lately). An empty flow only remembers that its
    /// tenant was served lately, and `V` passes it only when requests are released: while
    /// held requests expire or hang up instead, every tenant and band ever held would stay.
    /// A flow forgotten early starts its next request at `V`, as a new one does.
    fn trim_idle(&mut self) {
        let count = self.flows.values().filter(|f| f.queue.is_empty()).count();
        // Usually one past the bound (each push adds at most one flow): one walk each.
        for _ in self.max_requests..count {
            let oldest = self
                .flows
                .iter()
                .filter(|(_, f)| f.queue.is_empty())
                .min_by(|a, b| a.1.finish.total_cmp(&b.1.finish))
                .map(|(k, _)| k.clone());
            if let Some(key) = oldest {
                self.flows.remove(&key);
            }
        }
    }
}

/// Bytes of a queue (`HoldQueue::encode`), little-endian: virtual time, then each flow's
/// priority, tenant (length, UTF-8), finish tag and requests (count, then each one's item,
/// priority, since and start tag). Written by hand: the filter's size is bounded (a
/// Kubernetes ConfigMap carries it) and a derived serializer cost 40 KB of it.
impl<T> HoldQueue<T> {
    pub fn encode(&self, out: &mut Vec<u8>, mut item: impl FnMut(&T, &mut Vec<u8>)) {
        out.extend(self.now_v.to_le_bytes());
        out.extend((self.flows.len() as u32).to_le_bytes());
        for ((priority, tenant), flow) in &self.flows {
            out.extend(priority.to_le_bytes());
            out.extend((tenant.len() as u32).to_le_bytes());
            out.extend(tenant.as_bytes());
            out.extend(flow.finish.to_le_bytes());
            out.extend((flow.queue.len() as u32).to_le_bytes());
            for h in &flow.queue {
                item(&h.item, out);
                out.extend(h.priority.to_le_bytes());
                out.extend(h.since.0.to_le_bytes());
                out.extend(h.start.to_le_bytes());
            }
        }
    }

    /// The queue `encode` wrote at the front of `bytes` (which then holds what follows), with
    /// these bounds; `None` when the bytes are not one.
    pub fn decode(
        bytes: &mut &[u8],
        max_requests: usize,
        priority_weight: f64,
        mut item: impl FnMut(&mut &[u8]) -> Option<T>,
    ) -> Option<HoldQueue<T>> {
        let mut q = HoldQueue::new(max_requests, priority_weight);
        q.now_v = f64::from_le_bytes(take(bytes)?);
        for _ in 0..u32::from_le_bytes(take(bytes)?) {
            let priority = i64::from_le_bytes(take(bytes)?);
            let len = u32::from_le_bytes(take(bytes)?) as usize;
            let tenant = String::from_utf8(take_n(bytes, len)?.to_vec()).ok()?;
            let finish = f64::from_le_bytes(take(bytes)?);
            let mut queue = VecDeque::new();
            for _ in 0..u32::from_le_bytes(take(bytes)?) {
                queue.push_back(Held {
                    item: item(bytes)?,
                    priority: i64::from_le_bytes(take(bytes)?),
                    since: Millis(u64::from_le_bytes(take(bytes)?)),
                    start: f64::from_le_bytes(take(bytes)?),
                });
            }
            q.len += queue.len();
            if q.flows.insert((priority, tenant), Flow { queue, finish }).is_some() {
                return None;
            }
        }
        Some(q)
    }
}

/// The next `N` bytes of `bytes`, taken off it.
pub fn take<const N: usize>(bytes: &mut &[u8]) -> Option<[u8; N]> {
    let head = take_n(bytes, N)?;
    head.try_into().ok()
}

fn take_n<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if bytes.len() < n {
        return None;
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Some(head)
}

#[cfg(test)]
mod tests;
