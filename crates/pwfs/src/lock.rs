//! lock: ordering of concurrent access to one file's data.
//!
//! Every inode carries a `FileLock` (in its cell, `fs::inode`): `read()` and `write()`
//! return guards; readers share, a writer excludes everyone (`LockMode::Inode`, one
//! reader-writer lock per file, which is what ext4's i_rwsem does). Range-granular
//! locking (mechanism 2) plugs in here, behind the same two calls with a byte range
//! added.
//!
//! The engine's lock order is written once, in `fs::inode`.

use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};

/// A sharded reader-writer lock: a reader takes the shard of its thread only, so
/// threads reading one file share no cache line here (measured: a plain rwlock's
/// reader count made two threads reading one cached file slower than one); a writer
/// takes every shard.
#[derive(Default)]
pub struct FileLock(ShardedLock<()>);

impl FileLock {
    pub fn read(&self) -> ShardedLockReadGuard<'_, ()> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write(&self) -> ShardedLockWriteGuard<'_, ()> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The write lock if no one holds the lock now.
    pub fn try_write(&self) -> Option<ShardedLockWriteGuard<'_, ()>> {
        match self.0.try_write() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
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
