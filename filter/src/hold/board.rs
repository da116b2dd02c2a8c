//! The board the process's workers share (`BOARD_KEY` in shared data): the held requests'
//! tickets in fair order and the heartbeats of the workers that hold them, and its bytes.

use kvroute_core::hold::{take, HoldQueue};
use kvroute_core::Millis;

use super::{SILENT_MS, STALE_GRACE_MS};

/// A held request on the board: the worker VM that holds its stream, its number there, and
/// the servers it may use (`Router::serving_mask`): a ticket waits behind the earlier ones
/// that may use any of the same servers, and only behind those.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub vm: u64,
    pub seq: u64,
    pub servers: u64,
}

/// What the process's workers share: the held requests in fair order, and when each worker
/// with tickets there last showed it lives.
pub(super) struct Board {
    pub(super) queue: HoldQueue<Ticket>,
    /// `(vm, ms)`.
    pub(super) beats: Vec<(u64, u64)>,
}

impl Board {
    /// The queue (`HoldQueue::encode`, a ticket as its three numbers), then the heartbeats.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + 40 * self.queue.len());
        self.queue.encode(&mut out, |t, out| {
            out.extend(t.vm.to_le_bytes());
            out.extend(t.seq.to_le_bytes());
            out.extend(t.servers.to_le_bytes());
        });
        out.extend((self.beats.len() as u32).to_le_bytes());
        for (vm, at) in &self.beats {
            out.extend(vm.to_le_bytes());
            out.extend(at.to_le_bytes());
        }
        out
    }

    pub(super) fn decode(mut bytes: &[u8], max_requests: usize, priority_weight: f64) -> Option<Board> {
        let b = &mut bytes;
        let queue = HoldQueue::decode(b, max_requests, priority_weight, |b| {
            Some(Ticket {
                vm: u64::from_le_bytes(take(b)?),
                seq: u64::from_le_bytes(take(b)?),
                servers: u64::from_le_bytes(take(b)?),
            })
        })?;
        let n = u32::from_le_bytes(take(b)?);
        let beats = (0..n)
            .map(|_| Some((u64::from_le_bytes(take(b)?), u64::from_le_bytes(take(b)?))))
            .collect::<Option<Vec<_>>>()?;
        b.is_empty().then_some(Board { queue, beats })
    }

    /// Every server some ticket on the board may use.
    pub(super) fn servers(&self) -> u64 {
        self.queue.iter().fold(0, |all, h| all | h.item.servers)
    }

    pub(super) fn beat_of(&self, vm: u64) -> Option<u64> {
        self.beats.iter().find(|b| b.0 == vm).map(|b| b.1)
    }

    pub(super) fn beat(&mut self, vm: u64, now: Millis) {
        match self.beats.iter_mut().find(|b| b.0 == vm) {
            Some(b) => b.1 = now.0,
            None => self.beats.push((vm, now.0)),
        }
    }

    /// Drops other workers' tickets when their worker went silent or they are well past
    /// `max_wait_ms` (their owner answers its own at its bound, never longer; a request's
    /// own shorter bound is not on the board), and the heartbeats of workers without
    /// tickets; whether anything changed.
    pub(super) fn drop_stale(&mut self, me: u64, now: Millis, max_wait_ms: u64) -> bool {
        let beats = &self.beats;
        let silent = |vm: u64| {
            beats
                .iter()
                .find(|b| b.0 == vm)
                .is_none_or(|b| now.0.saturating_sub(b.1) >= SILENT_MS)
        };
        let dropped = self.queue.remove_where(|h| {
            h.item.vm != me && (silent(h.item.vm) || now.since(h.since) >= max_wait_ms.saturating_add(STALE_GRACE_MS))
        });
        let queue = &self.queue;
        let before = self.beats.len();
        self.beats.retain(|b| queue.iter().any(|h| h.item.vm == b.0));
        !dropped.is_empty() || self.beats.len() != before
    }
}
