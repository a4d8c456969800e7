//! The order in which the reads of one onboard request reach the eviction
//! policy. The server reads a request's blocks at once (server/onboard.rs),
//! but the policy must see them accessed in request order, as it did when
//! they were read one by one: its recency order among them is part of what
//! it keeps (and the replay's check that kvtierd's hits equal the dry
//! run's depends on it). Each read runs as job `i` of an [`AccessOrder`];
//! G3's policy touch of job `i` waits until jobs `0..i` have finished
//! (bounded by [`TURN_WAIT_MS`]), so only the touches are in order, never
//! the I/O.

use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Longest a touch waits for the earlier jobs of its request (they are
/// reads in flight beside it); past it the touch goes ahead out of order
/// rather than holding a reader.
pub const TURN_WAIT_MS: u64 = 2_000;

#[derive(Debug)]
struct Turns {
    /// Jobs finished, by index.
    done: Vec<bool>,
    /// The first job not finished.
    next: usize,
}

/// The jobs of one request.
#[derive(Debug)]
pub struct AccessOrder {
    turns: Mutex<Turns>,
    cv: Condvar,
}

thread_local! {
    static CURRENT: RefCell<Option<(Arc<AccessOrder>, usize)>> = const { RefCell::new(None) };
}

impl AccessOrder {
    /// An order over `jobs` jobs.
    pub fn new(jobs: usize) -> Arc<AccessOrder> {
        Arc::new(AccessOrder {
            turns: Mutex::new(Turns {
                done: vec![false; jobs],
                next: 0,
            }),
            cv: Condvar::new(),
        })
    }

    /// Runs `f` (one read) as job `i`: G3 policy touches on this thread
    /// inside it wait for jobs `0..i`. Job `i` counts as finished when `f`
    /// returns (hit, miss, error or panic).
    pub fn run<R>(self: &Arc<Self>, i: usize, f: impl FnOnce() -> R) -> R {
        struct Finish<'a>(&'a AccessOrder, usize);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                CURRENT.with(|c| c.borrow_mut().take());
                self.0.finish(self.1);
            }
        }
        CURRENT.with(|c| *c.borrow_mut() = Some((self.clone(), i)));
        let _finish = Finish(self, i);
        f()
    }

    fn finish(&self, i: usize) {
        let Ok(mut t) = self.turns.lock() else { return };
        if let Some(d) = t.done.get_mut(i) {
            *d = true;
        }
        while t.done.get(t.next).copied().unwrap_or(false) {
            t.next += 1;
        }
        self.cv.notify_all();
    }

    fn wait_turn(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_millis(TURN_WAIT_MS);
        let Ok(mut t) = self.turns.lock() else { return };
        while t.next < i {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            match self.cv.wait_timeout(t, left) {
                Ok((g, _)) => t = g,
                Err(_) => return,
            }
        }
    }
}

/// Called by G3 just before a read's policy touch: waits for this thread's
/// turn when it runs as a job of an [`AccessOrder`], else returns at once.
pub(super) fn wait_for_turn() {
    let cur = CURRENT.with(|c| c.borrow().clone());
    if let Some((order, i)) = cur {
        order.wait_turn(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touches_happen_in_job_order_whatever_order_the_reads_finish() {
        let order = AccessOrder::new(4);
        let seen = Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            // Job 3 finishes its "read" first, job 0 last.
            for i in (0..4).rev() {
                let order = order.clone();
                let seen = &seen;
                sc.spawn(move || {
                    order.run(i, || {
                        std::thread::sleep(Duration::from_millis(5 * (4 - i as u64)));
                        wait_for_turn();
                        seen.lock().unwrap().push(i);
                    })
                });
            }
        });
        assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_job_that_never_touches_still_lets_the_next_one_go() {
        let order = AccessOrder::new(2);
        order.run(0, || {});
        let t = Instant::now();
        order.run(1, wait_for_turn);
        assert!(t.elapsed() < Duration::from_millis(TURN_WAIT_MS));
        // Outside any order: returns at once.
        wait_for_turn();
    }
}
