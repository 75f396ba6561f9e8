//! lock: ordering of concurrent access to one file's data.
//!
//! Every inode carries a `FileLock` (in its cell, `fs::inode`): `read()` and `write()`
//! return guards; readers share, a writer excludes everyone (`LockMode::Inode`, one
//! reader-writer lock per file, which is what ext4's i_rwsem does). Range-granular
//! locking (mechanism 2) plugs in here, behind the same two calls with a byte range
//! added.
//!
//! The engine's lock order is written once, in `fs::inode`.

use crossbeam_utils::CachePadded;
use parking_lot::lock_api::RawRwLock as _;
use parking_lot::RawRwLock;
use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::sync::OnceLock;

/// Most shards a `PerCpuRwLock` has: readers on more CPUs than this share shards.
pub const MAX_SHARDS: usize = 8;

/// Shards in use: one per CPU of this machine (rounded up to a power of two), at most
/// `MAX_SHARDS`. A writer takes every one, so a writer costs a lock per CPU, not per
/// possible shard.
fn shards_in_use() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        // The CPUs configured, not those this process may use: `sched_getcpu`
        // numbers them all, and with up to eight of them two allowed CPUs never fall
        // into one shard (past eight, CPUs share shards). (Read once: glibc reads
        // /sys for it.)
        // SAFETY: sysconf has no memory arguments.
        let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
        // A power of two: a reader finds its shard with a mask, not a division.
        usize::try_from(n).unwrap_or(MAX_SHARDS).clamp(1, MAX_SHARDS).next_power_of_two()
    })
}

/// The slot of the CPU this thread runs on now, below `MAX_SHARDS` (glibc reads the
/// CPU from the thread's rseq area: no system call). Also for counters kept per CPU.
fn cpu_slot() -> usize {
    // SAFETY: sched_getcpu has no arguments; it returns -1 when it cannot tell.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).unwrap_or(0) & (shards_in_use() - 1)
}

/// A reader-writer lock sharded by CPU: a reader takes the shard of its CPU only, so
/// threads reading on different CPUs share no cache line here (measured: a plain
/// rwlock's reader count made two threads reading one cached file slower than one);
/// a writer takes every shard in use, in order. Shards follow CPUs, not threads (as
/// `crossbeam`'s `ShardedLock` does, with eight shards whatever the machine): on this
/// 2-core machine a write takes two locks instead of eight, and two readers on two
/// CPUs never meet in one shard. A thread moved to another CPU while it holds a read
/// guard lets go of the shard it took.
pub struct PerCpuRwLock<T> {
    /// One per CPU in use, on the heap: a lock inline would make whatever holds it
    /// (an inode's cell) aligned to the cache line, and every allocation of it an
    /// aligned one.
    shards: Box<[CachePadded<RawRwLock>]>,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through guards: shared (`&T`) under a shard taken
// shared, exclusive (`&mut T`) under every shard in use taken exclusive, as for
// `std::sync::RwLock`.
unsafe impl<T: Send> Send for PerCpuRwLock<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for PerCpuRwLock<T> {}

/// The file-access lock of an inode.
pub type FileLock = PerCpuRwLock<()>;

impl<T: Default> Default for PerCpuRwLock<T> {
    fn default() -> Self {
        PerCpuRwLock::new(T::default())
    }
}

/// A shared hold of one shard of a `PerCpuRwLock`. Let go by the thread that took
/// it (not `Send`, as parking_lot's own guards).
#[must_use = "the lock is let go when the guard is dropped"]
pub struct ReadGuard<'a, T> {
    lock: &'a PerCpuRwLock<T>,
    shard: usize,
    _not_send: PhantomData<*const ()>,
}

// SAFETY: a shared reference to the guard only reads the value, as `&T` would.
unsafe impl<T: Sync> Sync for ReadGuard<'_, T> {}

impl<T> Drop for ReadGuard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: this guard took the shard shared, and lets it go once.
        unsafe { self.lock.shards[self.shard].unlock_shared() }
    }
}

impl<T> ReadGuard<'_, T> {
    /// The CPU slot the guard took (`cpu_slot` when it was taken): for counters kept
    /// per CPU, without asking again.
    pub fn slot(&self) -> usize {
        self.shard
    }
}

impl<T> std::ops::Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: a shard held shared excludes every writer.
        unsafe { &*self.lock.value.get() }
    }
}

/// An exclusive hold of every shard in use of a `PerCpuRwLock` (not `Send`).
#[must_use = "the lock is let go when the guard is dropped"]
pub struct WriteGuard<'a, T> {
    lock: &'a PerCpuRwLock<T>,
    _not_send: PhantomData<*const ()>,
}

// SAFETY: a shared reference to the guard only reads the value, as `&T` would.
unsafe impl<T: Sync> Sync for WriteGuard<'_, T> {}

impl<T> Drop for WriteGuard<'_, T> {
    fn drop(&mut self) {
        for s in self.lock.shards.iter().rev() {
            // SAFETY: this guard took every shard in use exclusively, once.
            unsafe { s.unlock_exclusive() }
        }
    }
}

impl<T> std::ops::Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: every shard held exclusively excludes everyone else.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as above.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> PerCpuRwLock<T> {
    pub fn new(value: T) -> Self {
        PerCpuRwLock {
            shards: (0..shards_in_use()).map(|_| CachePadded::new(RawRwLock::INIT)).collect(),
            value: UnsafeCell::new(value),
        }
    }

    /// The shared side, on the shard of this thread's CPU (`ReadGuard::slot`).
    pub fn read(&self) -> ReadGuard<'_, T> {
        let shard = cpu_slot();
        self.shards[shard].lock_shared();
        ReadGuard { lock: self, shard, _not_send: PhantomData }
    }

    pub fn write(&self) -> WriteGuard<'_, T> {
        for s in self.shards.iter() {
            s.lock_exclusive();
        }
        WriteGuard { lock: self, _not_send: PhantomData }
    }

    /// The write lock if no one holds the lock now.
    pub fn try_write(&self) -> Option<WriteGuard<'_, T>> {
        for (i, s) in self.shards.iter().enumerate() {
            if !s.try_lock_exclusive() {
                for taken in self.shards[..i].iter().rev() {
                    // SAFETY: taken exclusively just above, by this call.
                    unsafe { taken.unlock_exclusive() }
                }
                return None;
            }
        }
        Some(WriteGuard { lock: self, _not_send: PhantomData })
    }
}

/// A mutex for short critical sections that many threads take (the metadata lock):
/// a waiter spins a few microseconds before it sleeps. Measured on 2 cores with two
/// threads creating and deleting files: parking at once (a futex wait, then a wake-up
/// syscall by the holder) cost more than the work under the lock.
pub struct SpinMutex<T>(parking_lot::Mutex<T>);

impl<T> SpinMutex<T> {
    pub fn new(v: T) -> Self {
        SpinMutex(parking_lot::Mutex::new(v))
    }

    pub fn lock(&self) -> parking_lot::MutexGuard<'_, T> {
        // About 10 µs of spinning (a `spin_loop` is tens of cycles), then sleep.
        for i in 0..SPINS {
            if let Some(g) = self.0.try_lock() {
                return g;
            }
            for _ in 0..(1u32 << (i / 64).min(4)) {
                std::hint::spin_loop();
            }
        }
        self.0.lock()
    }
}

const SPINS: u32 = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Duration;

    /// Pin the calling thread to one CPU, so that readers land in different shards.
    fn pin(cpu: usize) {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity
        // only read and write the set passed.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu % n, &mut set);
            let r = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            assert_eq!(r, 0, "pinning to CPU {cpu}: {}", std::io::Error::last_os_error());
        }
    }

    #[test]
    fn readers_share_and_a_writer_waits_for_readers_on_every_cpu() {
        let lock = FileLock::default();
        for cpu in 0..shards_in_use() {
            // A reader pinned to `cpu` holds the lock until told to let go.
            let (held_tx, held_rx) = std::sync::mpsc::channel();
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            std::thread::scope(|s| {
                let lock = &lock;
                s.spawn(move || {
                    pin(cpu);
                    let _g = lock.read();
                    held_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                });
                held_rx.recv().unwrap();
                let second = lock.read();
                assert!(lock.try_write().is_none(), "a reader on CPU {cpu} holds the lock");
                drop(second);
                assert!(lock.try_write().is_none(), "the reader on CPU {cpu} still holds it");
                go_tx.send(()).unwrap();
            });
            assert!(lock.try_write().is_some(), "no reader holds the lock any more");
        }
    }

    #[test]
    fn a_writer_excludes_readers_and_writers() {
        let lock = FileLock::default();
        let w = lock.write();
        assert!(lock.try_write().is_none());
        let entered = AtomicBool::new(false);
        std::thread::scope(|s| {
            let r = s.spawn(|| {
                let _g = lock.read();
                entered.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!entered.load(Ordering::SeqCst), "a reader got in beside a writer");
            drop(w);
            r.join().unwrap();
        });
        assert!(entered.load(Ordering::SeqCst));
    }

    /// Writers on every CPU change two counters together; readers on every CPU never
    /// see them apart.
    #[test]
    fn readers_never_see_a_half_done_write() {
        let (lock, reads) = (PerCpuRwLock::new((0u64, 0u64)), AtomicU64::new(0));
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()).max(2);
        std::thread::scope(|s| {
            for t in 0..2 * n {
                let (lock, reads) = (&lock, &reads);
                s.spawn(move || {
                    pin(t);
                    for _ in 0..20_000 {
                        if t % 2 == 0 {
                            let mut p = lock.write();
                            // Two stores the compiler may not merge: a reader between
                            // them sees the pair apart unless the lock keeps it out.
                            p.0 += 1;
                            std::hint::black_box(&mut *p);
                            p.1 += 1;
                        } else {
                            let p = lock.read();
                            assert_eq!(p.0, p.1, "a reader saw a write half done");
                            reads.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(*lock.read(), (20_000 * n as u64, 20_000 * n as u64));
        assert_eq!(reads.into_inner(), 20_000 * n as u64);
    }
}
