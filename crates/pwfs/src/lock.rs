//! lock: ordering of concurrent access to one file's data.
//!
//! Interface: `read(ino)` / `write(ino)` return guards; readers share, a writer
//! excludes everyone (`LockMode::Inode`, one reader-writer lock per file, which is
//! what ext4's i_rwsem does). Range-granular locking (mechanism 2) plugs in here,
//! behind the same two calls with a byte range added.
//!
//! Lock order (whole engine): inode lock → commit lock → page lock → metadata lock →
//! cache map lock.

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

pub type ReadGuard = parking_lot::lock_api::ArcRwLockReadGuard<parking_lot::RawRwLock, ()>;
pub type WriteGuard = parking_lot::lock_api::ArcRwLockWriteGuard<parking_lot::RawRwLock, ()>;

#[derive(Default)]
pub struct LockTable {
    locks: Mutex<HashMap<u64, Weak<RwLock<()>>>>,
}

impl LockTable {
    fn get(&self, ino: u64) -> Arc<RwLock<()>> {
        let mut m = self.locks.lock();
        if let Some(l) = m.get(&ino).and_then(Weak::upgrade) {
            return l;
        }
        if m.len() > 4096 {
            m.retain(|_, w| w.strong_count() > 0);
        }
        let l = Arc::new(RwLock::new(()));
        m.insert(ino, Arc::downgrade(&l));
        l
    }

    pub fn read(&self, ino: u64) -> ReadGuard {
        self.get(ino).read_arc()
    }

    pub fn write(&self, ino: u64) -> WriteGuard {
        self.get(ino).write_arc()
    }
}
