//! readahead: a sequential reader finds the pages it asks for next already read:
//! background readers fetch windows ahead of it while it copies out the ones it has.

use crate::cache::Page;
use crate::format::BLOCK;
use crate::fs::FsInner;
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// Where a sequential reader is expected next, and the first page not yet queued for
/// reading ahead. Each open file has its own (as in Linux), and each inode one for
/// callers without a handle (FUSE), so that readers of one file through different
/// handles neither share a cache line nor confuse each other's streams.
/// Shared with the readahead requests it queues, which look where the reader is.
pub struct RaState(Arc<Mutex<(u64, u64)>>);

impl Default for RaState {
    fn default() -> Self {
        RaState(Arc::new(Mutex::new((u64::MAX, 0))))
    }
}

impl RaState {
    /// Whether a read at `offset` continues the last one (a sequential stream).
    pub fn continues(&self, offset: u64) -> bool {
        self.0.lock().0 == offset
    }
}

/// A readahead request: pages `first..first + n` of `ino`, for the reader whose state
/// is `reader`.
pub(crate) type RaRequest = (u64, u64, u64, Arc<Mutex<(u64, u64)>>);
type RaQueue = Arc<Mutex<std::sync::mpsc::Receiver<RaRequest>>>;

pub(crate) fn readahead_thread(fs: Weak<FsInner>, rx: RaQueue) {
    loop {
        let Ok((ino, first, n, reader)) = rx.lock().recv() else { return };
        let Some(inner) = fs.upgrade() else { return };
        readahead_one(&inner, ino, first, n, &reader);
        inner.ra_pending.fetch_sub(1, Ordering::Release);
    }
}

fn readahead_one(inner: &FsInner, ino: u64, first: u64, n: u64, reader: &Mutex<(u64, u64)>) {
    // Pages are inserted under the inode lock (as a reader: a truncate cannot run
    // between the size check and the insert, and finds them in the cache after it),
    // and read without it.
    let new: Vec<Arc<Page>> = {
        let Ok(cell) = inner.cell(ino) else { return };
        let _g = cell.io.read();
        let size = {
            let node = cell.lock();
            if node.freed {
                return;
            }
            node.d.size
        };
        // Pages the reader has passed since this was queued (it read them itself,
        // and a mount whose kernel keeps them dropped them behind it): not again.
        let passed = match reader.lock().0 {
            u64::MAX => 0,
            at => at / BLOCK,
        };
        let end = (first + n).min(size.div_ceil(BLOCK));
        let first = first.max(passed);
        if first >= end {
            return;
        }
        let n = end - first;
        cell.note_pages(first + n);
        inner.cache.read_ahead_range(ino, first, n).into_iter().filter(|p| p.1).map(|p| p.0).collect()
    };
    // A failed readahead fails its pages; the reader fetches them again.
    if let Err(e) = inner.fetch(ino, new) {
        tracing::debug!(ino, first, "readahead failed: {e}");
    }
}

impl FsInner {
    /// Note a read of `len` bytes at `offset`. A reader that continues where it left
    /// off is sequential: keep up to five windows of pages ahead of it queued for the
    /// background readers, in requests of two windows, so that two requests are in
    /// flight while the reader copies (measured: one window ahead left the device
    /// idle between requests; see docs/BENCHMARKS.md).
    pub fn readahead(&self, ino: u64, ra: &RaState, offset: u64, len: u64, size: u64) {
        // Up to five windows may be queued ahead: keep them well inside the cache, or
        // readahead evicts what the reader is about to read.
        let cap = (self.cache.capacity() as u64 / 16).max(1);
        // At least a request (a reader of 1 MiB pieces stays behind it), never more
        // than the bound, however large the request.
        let window = self.config.readahead_pages.max(len.div_ceil(BLOCK)).min(cap);
        if self.config.readahead_pages == 0 {
            return;
        }
        let end = (offset + len).div_ceil(BLOCK);
        let queue = {
            let mut ra = ra.0.lock();
            let (expected, frontier) = *ra;
            let sequential = expected == offset;
            let mut frontier = if sequential { frontier.max(end) } else { end };
            let mut queue = None;
            if sequential && frontier < end + 5 * window && frontier * BLOCK < size {
                queue = Some((frontier, 2 * window));
                frontier += 2 * window;
            }
            *ra = (offset + len, frontier);
            queue
        };
        if let Some((from, n)) = queue {
            if let Some(q) = &*self.ra_queue.lock() {
                self.ra_pending.fetch_add(1, Ordering::Relaxed);
                if q.send((ino, from, n, ra.0.clone())).is_err() {
                    self.ra_pending.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::mem::MemDevice;

    /// A readahead request that runs after its reader got past part of it reads only
    /// the rest: the reader read those pages itself, and a mount whose kernel keeps
    /// them dropped them behind it (fetching them again would waste a device read and
    /// the room).
    #[test]
    fn readahead_skips_the_pages_its_reader_has_passed() {
        let dev = Arc::new(MemDevice::new(16 << 20));
        crate::mkfs(&*dev, &crate::MkfsOptions::default()).unwrap();
        let fs = crate::Fs::mount(dev, crate::Config { readahead_pages: 0, ..Default::default() }).unwrap();
        fs.write_file("/f", &vec![7u8; 64 * BLOCK as usize]).unwrap();
        fs.evict_cache().unwrap();
        let ino = fs.metadata("/f").unwrap().ino;
        let cached = |i: u64| fs.inner.cache.contains((ino, i));
        // The reader is at byte 100 of page 20: pages 16..20 are behind it.
        readahead_one(&fs.inner, ino, 16, 16, &Mutex::new((20 * BLOCK + 100, 0)));
        assert!((16..20).all(|i| !cached(i)), "pages the reader passed are not read ahead");
        assert!((20..32).all(cached), "the rest is");
        // A reader that has read nothing yet, and one past the whole request.
        readahead_one(&fs.inner, ino, 0, 8, &Mutex::new((u64::MAX, 0)));
        assert!((0..8).all(cached));
        readahead_one(&fs.inner, ino, 40, 8, &Mutex::new((60 * BLOCK, 0)));
        assert!((40..48).all(|i| !cached(i)));
    }
}
