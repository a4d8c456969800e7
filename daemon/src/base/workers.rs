//! Persistent helper threads for the fork-join I/O of one request (a
//! batch's file writes, an onboard's block reads, a group commit's
//! directory fsyncs), instead of scoped threads started per request
//! (docs/BENCHMARKS.md measured 470-510 us to start and join 7 of them,
//! of the order of a 64 KiB request itself).
//!
//! [`fan_out`] runs one closure on the calling thread and on up to
//! `helpers` pooled threads at once; the closure pulls work from a queue
//! the caller owns, so any number of copies is correct, and a helper that
//! has not started by the time the caller's own copy returns (all work
//! taken) is cancelled rather than waited for. The pool grows on demand
//! up to [`THREADS_MAX`] and its threads stay parked between requests.
//!
//! Architecture invariant: `fan_out` returns (or unwinds) only after every
//! helper that started the closure has returned from it, which is what
//! makes lending it a borrowed closure sound.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Threads the pool starts at most (beyond it, requests run with fewer
/// helpers).
pub const THREADS_MAX: usize = 256;

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const CANCELLED: u8 = 2;

/// What one helper runs: the caller's closure with its lifetime erased
/// (see `fan_out` for why that is sound).
type Work = &'static (dyn Fn() + Sync);

struct Task {
    work: Work,
    state: AtomicU8,
    done: Arc<Latch>,
}

/// Counts the helpers of one `fan_out` not yet finished or cancelled
/// (set to all of them up front, so that no helper can start unseen).
#[derive(Default)]
struct Latch {
    running: Mutex<usize>,
    cv: Condvar,
    panics: std::sync::atomic::AtomicUsize,
}

impl Latch {
    fn sub(&self) {
        if let Ok(mut r) = self.running.lock() {
            *r = r.saturating_sub(1);
            if *r == 0 {
                self.cv.notify_all();
            }
        }
    }
    fn wait(&self) {
        let Ok(mut r) = self.running.lock() else {
            return;
        };
        while *r > 0 {
            r = match self.cv.wait(r) {
                Ok(r) => r,
                Err(_) => return,
            };
        }
    }
}

#[derive(Default)]
struct Queue {
    tasks: VecDeque<Arc<Task>>,
    threads: usize,
    idle: usize,
}

/// The pool (one per process: [`fan_out`] uses it).
#[derive(Default)]
pub struct Workers {
    q: Mutex<Queue>,
    cv: Condvar,
}

fn pool() -> &'static Arc<Workers> {
    static POOL: OnceLock<Arc<Workers>> = OnceLock::new();
    POOL.get_or_init(|| Arc::new(Workers::default()))
}

/// Runs `f` on this thread and on up to `helpers` pooled threads at once;
/// returns after every copy that started has returned. `f` must take its
/// work from a shared queue (each copy returns when the queue is empty).
/// A helper copy that panics is logged and counted in the result (its
/// work items then have no outcome; callers report those as errors).
pub fn fan_out<F: Fn() + Sync>(helpers: usize, f: &F) -> usize {
    pool().fan_out(helpers, f)
}

/// Threads the pool has started so far (for tests and stats).
pub fn threads() -> usize {
    pool().q.lock().map(|q| q.threads).unwrap_or(0)
}

impl Workers {
    fn fan_out<F: Fn() + Sync>(self: &Arc<Self>, helpers: usize, f: &F) -> usize {
        if helpers == 0 {
            f();
            return 0;
        }
        let dynf: &(dyn Fn() + Sync) = f;
        // SAFETY: the reference is used only by helpers that start before
        // `Guard::drop` cancels the rest, and that drop (run on return and
        // on unwind alike) waits until every started helper returned, so
        // no use outlives the borrow of `f`.
        let work: Work = unsafe { std::mem::transmute::<&(dyn Fn() + Sync), Work>(dynf) };
        let done = Arc::new(Latch {
            running: Mutex::new(helpers),
            ..Latch::default()
        });
        let tasks: Vec<Arc<Task>> = (0..helpers)
            .map(|_| {
                Arc::new(Task {
                    work,
                    state: AtomicU8::new(QUEUED),
                    done: done.clone(),
                })
            })
            .collect();
        struct Guard<'a> {
            tasks: &'a [Arc<Task>],
            done: &'a Latch,
        }
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                // Not started yet: never will be (the work is all taken).
                for t in self.tasks {
                    if t.state
                        .compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        self.done.sub();
                    }
                }
                self.done.wait();
            }
        }
        let guard = Guard {
            tasks: &tasks,
            done: &done,
        };
        self.submit(&tasks);
        f();
        drop(guard);
        done.panics.load(Ordering::Relaxed)
    }

    fn submit(self: &Arc<Self>, tasks: &[Arc<Task>]) {
        let Ok(mut q) = self.q.lock() else {
            return; // no helpers: the caller's copy does the work
        };
        q.tasks.extend(tasks.iter().cloned());
        // Enough threads for what is queued, up to the cap.
        let short = q.tasks.len().saturating_sub(q.idle);
        let room = THREADS_MAX.saturating_sub(q.threads);
        for _ in 0..short.min(room) {
            let me = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name("io-worker".into())
                .spawn(move || me.serve());
            if spawned.is_err() {
                break; // fewer helpers; queued tasks wait for running ones
            }
            q.threads += 1;
        }
        drop(q);
        self.cv.notify_all();
    }

    /// A pooled thread: runs queued tasks forever.
    fn serve(&self) {
        loop {
            let task = {
                let Ok(mut q) = self.q.lock() else { return };
                loop {
                    if let Some(t) = q.tasks.pop_front() {
                        break t;
                    }
                    q.idle += 1;
                    q = match self.cv.wait(q) {
                        Ok(q) => q,
                        Err(_) => return,
                    };
                    q.idle -= 1;
                }
            };
            if task
                .state
                .compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue; // cancelled (and counted off) by its caller
            }
            let work = task.work;
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
                tracing::error!("an I/O worker's task panicked");
                task.done.panics.fetch_add(1, Ordering::Relaxed);
            }
            task.done.sub();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Every item is done exactly once, by the caller and helpers
    /// together, and the pool's threads are reused across calls.
    #[test]
    fn fan_out_runs_every_item_once_and_reuses_threads() {
        for round in 0..50 {
            let items: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            let next = AtomicUsize::new(0);
            let f = || loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(it) = items.get(k) else { break };
                it.fetch_add(1, Ordering::Relaxed);
                if round % 10 == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
            };
            assert_eq!(fan_out(7, &f), 0);
            assert!(items.iter().all(|i| i.load(Ordering::Relaxed) == 1));
        }
        // 50 calls of 7 helpers did not start 350 threads.
        assert!(threads() <= THREADS_MAX && threads() < 350, "{}", threads());
    }

    /// A helper that panics is counted; the caller still gets control
    /// back after every started helper ended.
    #[test]
    fn a_panicking_helper_is_counted_and_waited_for() {
        let calls = AtomicUsize::new(0);
        let caller = std::thread::current().id();
        let f = || {
            calls.fetch_add(1, Ordering::SeqCst);
            if std::thread::current().id() != caller {
                panic!("helper panics on purpose");
            }
            // Hold the caller's copy until the helper ran (bounded).
            let t = std::time::Instant::now();
            while calls.load(Ordering::SeqCst) < 2
                && t.elapsed() < std::time::Duration::from_secs(10)
            {
                std::thread::yield_now();
            }
        };
        let panics = fan_out(1, &f);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(panics, 1);
    }
}
