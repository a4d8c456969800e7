//! The order in which the reads of one onboard request reach the eviction
//! policy. The server reads a request's blocks at once (server/onboard.rs),
//! but the policy must see them accessed in request order, as it did when
//! they were read one by one: its recency order among them is part of what
//! it keeps (and the replay's check that kvtierd's hits equal the dry
//! run's depends on it). Each read runs as job `i` of an [`AccessOrder`];
//! G3's policy touch of job `i` is handed over ([`touch_in_turn`]) and run
//! by whichever job completes the prefix `0..=i`, so only the touches are
//! in order, never the I/O, and no reader waits for another (readers used
//! to block until their turn: a futex wait and wake per block, measurable
//! at small blocks).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

/// A deferred policy touch.
pub type Touch = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Turns {
    /// Jobs finished, by index.
    done: Vec<bool>,
    /// Touches handed over by jobs not yet in turn, by index.
    pending: Vec<Option<Touch>>,
    /// The first job not finished.
    next: usize,
}

/// The jobs of one request.
pub struct AccessOrder {
    turns: Mutex<Turns>,
}

impl std::fmt::Debug for AccessOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessOrder").finish_non_exhaustive()
    }
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
                pending: (0..jobs).map(|_| None).collect(),
                next: 0,
            }),
        })
    }

    /// Runs `f` (one read) as job `i`: a G3 policy touch on this thread
    /// inside it runs once jobs `0..i` have finished. Job `i` counts as
    /// finished when `f` returns (hit, miss, error or panic).
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

    /// Job `i` is done: runs the touches of every job now in turn, in
    /// order (under the lock, so two finishing jobs cannot reorder them).
    fn finish(&self, i: usize) {
        let Ok(mut t) = self.turns.lock() else { return };
        if let Some(d) = t.done.get_mut(i) {
            *d = true;
        }
        while t.done.get(t.next).copied().unwrap_or(false) {
            let n = t.next;
            if let Some(touch) = t.pending.get_mut(n).and_then(Option::take) {
                touch();
            }
            t.next += 1;
        }
    }

    /// Job `i`'s touch: now if its turn has come, else kept for the job
    /// that completes the prefix before it.
    fn touch(&self, i: usize, touch: Touch) {
        let Ok(mut t) = self.turns.lock() else {
            touch();
            return;
        };
        if t.next >= i {
            drop(t);
            touch();
            return;
        }
        match t.pending.get_mut(i) {
            Some(slot) => *slot = Some(touch),
            None => {
                drop(t);
                touch();
            }
        }
    }
}

impl Drop for AccessOrder {
    /// Touches of jobs that finished behind one that never ran (its
    /// thread died before taking it) still run, in order.
    fn drop(&mut self) {
        let t = match self.turns.get_mut() {
            Ok(t) => t,
            Err(p) => p.into_inner(),
        };
        for touch in t.pending.iter_mut().filter_map(Option::take) {
            touch();
        }
    }
}

/// Called by G3 for a read's policy touch: run in request order when this
/// thread runs a job of an [`AccessOrder`] (possibly later, by another
/// thread), else at once.
pub fn touch_in_turn(touch: Touch) {
    let cur = CURRENT.with(|c| c.borrow().clone());
    match cur {
        Some((order, i)) => order.touch(i, touch),
        None => touch(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn record(seen: &Arc<Mutex<Vec<usize>>>, i: usize) -> Touch {
        let seen = Arc::clone(seen);
        Box::new(move || seen.lock().unwrap().push(i))
    }

    #[test]
    fn touches_happen_in_job_order_whatever_order_the_reads_finish() {
        let order = AccessOrder::new(4);
        let seen = Arc::new(Mutex::new(Vec::new()));
        std::thread::scope(|sc| {
            // Job 3 finishes its "read" first, job 0 last.
            for i in (0..4).rev() {
                let order = order.clone();
                let seen = &seen;
                sc.spawn(move || {
                    order.run(i, || {
                        std::thread::sleep(Duration::from_millis(5 * (4 - i as u64)));
                        touch_in_turn(record(seen, i));
                    })
                });
            }
        });
        assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_read_never_waits_for_an_earlier_one() {
        // Job 1 touches and returns while job 0 is still "reading": its
        // touch runs when job 0 finishes, after job 0's own.
        let order = AccessOrder::new(2);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let early = std::thread::scope(|sc| {
            let o = order.clone();
            let s = &seen;
            let first = sc.spawn(move || {
                o.run(0, || {
                    // Job 0's read ends when job 1 has returned.
                    let _ = rx.recv();
                    touch_in_turn(record(s, 0));
                })
            });
            order.run(1, || touch_in_turn(record(&seen, 1)));
            let early = seen.lock().unwrap().clone();
            tx.send(()).unwrap();
            first.join().unwrap();
            early
        });
        assert!(early.is_empty(), "job 1 touched out of turn: {early:?}");
        assert_eq!(*seen.lock().unwrap(), vec![0, 1]);
    }

    #[test]
    fn a_job_that_never_touches_or_never_runs_holds_nothing_back() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let order = AccessOrder::new(3);
        order.run(0, || {});
        order.run(1, || touch_in_turn(record(&seen, 1)));
        assert_eq!(*seen.lock().unwrap(), vec![1]);
        // Job 1 of another order runs; its job 0 never does.
        let order = AccessOrder::new(2);
        order.run(1, || touch_in_turn(record(&seen, 2)));
        drop(order);
        assert_eq!(*seen.lock().unwrap(), vec![1, 2]);
        // Outside any order: at once.
        touch_in_turn(record(&seen, 3));
        assert_eq!(*seen.lock().unwrap(), vec![1, 2, 3]);
    }
}
