//! The asynchronous I/O stack (mechanism 4): read misses submitted before their cache
//! entries, racing readers, failed reads, holes, hybrid polling on io_uring. The
//! overlapped commit's order on the medium is checked under the crash tests
//! (`crash.rs`, `check_commit_order`), for both stacks.

mod common;
use common::*;
use pwfs::device::sim::{SimConfig, SimDevice};
use pwfs::{Config, Fs, MkfsOptions, OpenOptions, Stack};
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const PAGES: u64 = 256;

/// Page `p` of the test file: every 8 bytes carry the page and the word's place.
fn page(p: u64) -> Vec<u8> {
    (0..512u64).flat_map(|w| (p << 32 | w).to_le_bytes()).collect()
}

fn async_config() -> Config {
    Config { stack: Stack::Async, cache_bytes: 64 * 4096, ..test_config() }
}

/// A file of PAGES pages written and synced, then a cold mount under the asynchronous
/// stack on a device with `cfg`'s faults and latency.
fn cold_file(cfg: SimConfig) -> (Arc<SimDevice>, Fs) {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, SimConfig::default(), test_config());
    let f = OpenOptions::new().write(true).create(true).open(&fs, "/f").unwrap();
    for p in 0..PAGES {
        f.write_at(&page(p), p * 4096).unwrap();
    }
    drop(f);
    fs.unmount().unwrap();
    let image = dev.snapshot();
    sim_fs(image, cfg, async_config())
}

#[test]
fn racing_readers_of_cold_pages_all_see_the_data() {
    let (_dev, fs) = cold_file(SimConfig { latency: Duration::from_micros(50), ..Default::default() });
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let fs = fs.clone();
            s.spawn(move || {
                let f = OpenOptions::new().read(true).open(&fs, "/f").unwrap();
                // All threads walk the same pages (in different orders and sizes), so
                // that misses on one page meet: one entry wins, the other reads are
                // discarded.
                for i in 0..PAGES {
                    let p = if t % 2 == 0 { i } else { PAGES - 1 - i };
                    let n = 1 + (t as usize % 3);
                    let mut buf = vec![0u8; 4096 * n];
                    let got = f.read_at(&mut buf, p * 4096).unwrap();
                    for k in 0..got / 4096 {
                        assert_eq!(
                            buf[k * 4096..(k + 1) * 4096],
                            page(p + k as u64)[..],
                            "thread {t}, page {}",
                            p + k as u64
                        );
                    }
                }
            });
        }
    });
    fs.unmount().unwrap();
}

#[test]
fn a_failed_read_is_an_error_and_the_next_one_reads_again() {
    let (dev, fs) = cold_file(SimConfig::default());
    let f = OpenOptions::new().read(true).open(&fs, "/f").unwrap();
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    let mut buf = vec![0u8; 8192];
    assert_eq!(errno(f.read_at(&mut buf, 40 * 4096)), libc::EIO);
    dev.set_config(SimConfig::default());
    assert_eq!(f.read_at(&mut buf, 40 * 4096).unwrap(), 8192);
    assert_eq!(buf[..4096], page(40)[..]);
    assert_eq!(buf[4096..], page(41)[..]);
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn holes_and_patched_pages_read_right_under_the_async_stack() {
    let (dev, fs) = cold_file(SimConfig::default());
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    // A hole past the data, and a partial write to a cold page (a patch under the
    // default fetch policy), then reads across all three kinds of page.
    f.write_at(b"tail", (PAGES + 3) * 4096).unwrap();
    f.write_at(b"patched", 10 * 4096 + 100).unwrap();
    let mut buf = vec![0u8; 4096 * 3];
    assert_eq!(f.read_at(&mut buf, 9 * 4096).unwrap(), buf.len());
    let mut want = page(9);
    let mut ten = page(10);
    ten[100..107].copy_from_slice(b"patched");
    want.extend(ten);
    want.extend(page(11));
    assert_eq!(buf, want);
    let mut hole = vec![1u8; 4096];
    assert_eq!(f.read_at(&mut hole, (PAGES + 1) * 4096).unwrap(), 4096);
    assert!(hole.iter().all(|b| *b == 0));
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn fsync_under_the_async_stack_is_durable() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let cfg = SimConfig { latency: Duration::from_micros(30), ..Default::default() };
    // Without hitchhiking (which carries these small writes in the commit block
    // alone: tests/hitchhike.rs).
    let (dev, fs) = sim_fs(image, cfg, Config { hitchhike: false, ..async_config() });
    let base = dev.start_recording();
    let f = OpenOptions::new().write(true).create(true).open(&fs, "/a").unwrap();
    f.write_at(&page(1), 0).unwrap();
    f.sync_all().unwrap();
    let before = dev.stats();
    f.write_at(&page(2), 4096).unwrap();
    f.sync_all().unwrap();
    let after = dev.stats();
    // One fsync of a block and a size change: the data and the journal body, the
    // commit block with FUA, and one flush before it (no second flush).
    assert_eq!(after.fua_writes - before.fua_writes, 1);
    assert_eq!(after.flushes - before.flushes, 1);
    // A crash now: what is not durable is dropped or torn (FUA writes are kept).
    let log = dev.log();
    let durable = pwfs::device::sim::crash_image(&base, &log, log.len(), 7);
    let (_d, fs2) = sim_fs(durable, SimConfig::default(), test_config());
    let mut buf = vec![0u8; 8192];
    let g = OpenOptions::new().read(true).open(&fs2, "/a").unwrap();
    assert_eq!(g.read_at(&mut buf, 0).unwrap(), 8192);
    assert_eq!(buf[..4096], page(1)[..]);
    assert_eq!(buf[4096..], page(2)[..]);
}

#[test]
fn hybrid_polling_on_io_uring_calibrates_and_serves() {
    let dir = std::env::temp_dir().join(format!("pwfs-aios-poll-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("img");
    pwfs::mkfs_image(&img, 16 * MIB, &MkfsOptions::default()).unwrap();
    let opts = pwfs::device::uring::UringOptions { poll: true, ..Default::default() };
    let dev = pwfs::device::uring::UringDevice::open(&img, &opts).unwrap();
    let spin = dev.poll_spin();
    assert!(spin >= Duration::from_micros(5) && spin <= Duration::from_micros(200), "spin {spin:?}");
    drop(dev);
    for stack in [Stack::Sync, Stack::Async] {
        let config = Config { stack, poll: true, trace_io: true, cache_bytes: 64 * 4096, ..test_config() };
        let fs = pwfs::mount_image(&img, config.clone()).unwrap();
        let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/p").unwrap();
        for p in 0..64 {
            f.write_at(&page(p), p * 4096).unwrap();
        }
        f.sync_all().unwrap();
        let t = fs.io_times().fsyncs;
        assert!(t.count == 1 && t.device_ns > 0, "{stack:?}: {t:?}");
        drop(f);
        fs.unmount().unwrap();
        let fs = pwfs::mount_image(&img, config).unwrap();
        let f = OpenOptions::new().read(true).open(&fs, "/p").unwrap();
        let mut buf = vec![0u8; 4096];
        for p in (0..64).rev() {
            f.read_at(&mut buf, p * 4096).unwrap();
            assert_eq!(buf, page(p), "{stack:?}, page {p}");
        }
        let t = fs.io_times();
        assert!(t.reads.count > 0 && t.reads.device_ns > 0, "{stack:?}: {t:?}");
        drop(f);
        fs.unmount().unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tree after a crash right now (what was not flushed is lost or torn).
fn crashed(base: &[u8], dev: &SimDevice) -> Fs {
    let log = dev.log();
    let img = pwfs::device::sim::crash_image(base, &log, log.len(), 3);
    sim_fs(img, SimConfig::default(), test_config()).1
}

fn content(fs: &Fs, path: &str) -> Vec<u8> {
    let f = OpenOptions::new().read(true).open(fs, path).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let n = f.read_at(&mut buf, 0).unwrap();
    buf.truncate(n);
    buf
}

#[test]
fn fsync_writes_its_own_file_and_files_whose_size_changed_not_every_file() {
    for stack in [Stack::Sync, Stack::Async] {
        let image = formatted_image(16 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), Config { stack, ..test_config() });
        for name in ["/a", "/b", "/f"] {
            let f = OpenOptions::new().write(true).create(true).open(&fs, name).unwrap();
            f.write_at(&page(0), 0).unwrap();
        }
        fs.sync().unwrap();
        let base = dev.start_recording();
        // An overwrite of /a in place, an append to /b, an overwrite of /f.
        let a = OpenOptions::new().write(true).open(&fs, "/a").unwrap();
        a.write_at(&page(7), 0).unwrap();
        let b = OpenOptions::new().write(true).open(&fs, "/b").unwrap();
        b.write_at(&page(8), 4096).unwrap();
        let f = OpenOptions::new().write(true).open(&fs, "/f").unwrap();
        f.write_at(&page(9), 0).unwrap();
        f.sync_all().unwrap();
        let after = crashed(&base, &dev);
        assert_eq!(content(&after, "/f"), page(9), "{stack:?}: the fsynced file");
        let mut grown = page(0);
        grown.extend(page(8));
        assert_eq!(content(&after, "/b"), grown, "{stack:?}: a file whose size the commit stores");
        assert_eq!(content(&after, "/a"), page(0), "{stack:?}: another file's overwrite is not written");
        // fdatasync of /f: the same rule.
        f.write_at(&page(10), 0).unwrap();
        f.sync_data().unwrap();
        assert_eq!(content(&crashed(&base, &dev), "/a"), page(0), "{stack:?}");
        // A sync of the file system writes everything.
        fs.sync().unwrap();
        let after = crashed(&base, &dev);
        assert_eq!(content(&after, "/a"), page(7), "{stack:?}");
        assert_eq!(content(&after, "/f"), page(10), "{stack:?}");
        drop((a, b, f));
        fs.unmount().unwrap();
        fsck_clean(&*dev);
    }
}

fn key(t: pwfs::format::Timespec) -> (i64, u32) {
    (t.sec, t.nsec)
}

#[test]
fn overwrites_within_a_clock_tick_make_fsync_commit_nothing() {
    for stack in [Stack::Sync, Stack::Async] {
        let (dev, fs) = mem_fs(16 * MIB);
        fs.unmount().unwrap();
        // Without hitchhiking: with it, a block the journal carries is committed by
        // each fsync (a commit block instead of the in-place write).
        let fs = Fs::mount(dev, Config { stack, hitchhike: false, ..test_config() }).unwrap();
        let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/db").unwrap();
        f.write_at(&page(0), 0).unwrap();
        f.sync_all().unwrap();
        let before = fs.journal_stats().commits;
        let t = std::time::Instant::now();
        let mut last = fs.metadata("/db").unwrap().mtime;
        for i in 0..200u64 {
            f.write_at(&page(i), 0).unwrap();
            f.sync_all().unwrap();
            let m = fs.metadata("/db").unwrap();
            assert!(key(m.mtime) >= key(last), "{stack:?}: mtime went back");
            assert_eq!(m.mtime, m.ctime, "{stack:?}");
            last = m.mtime;
        }
        // The write time moves with the kernel's coarse clock (at most 1000 ticks a
        // second): a commit at most once a tick, not once per fsync (plus one: the
        // first write may already be in a tick after the sync before the loop).
        let ticks = t.elapsed().as_millis() as u64 + 2;
        let commits = fs.journal_stats().commits - before;
        assert!(commits <= ticks, "{stack:?}: {commits} commits in {ticks} ms");
        assert!(commits < 200, "{stack:?}: every fsync committed");
        // The data is there, and a change of attributes still moves the change time.
        let mut buf = vec![0u8; 4096];
        f.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, page(199));
        fs.set_permissions("/db", 0o600).unwrap();
        let m = fs.metadata("/db").unwrap();
        assert!(key(m.ctime) >= key(last));
        f.write_at(&page(1), 0).unwrap();
        let m2 = fs.metadata("/db").unwrap();
        assert!(
            key(m2.mtime) >= key(m.ctime) && key(m2.ctime) >= key(m.ctime),
            "{stack:?}: a write after a chmod went back in time"
        );
        drop(f);
        fs.unmount().unwrap();
    }
}

#[test]
fn fsync_after_background_write_back_still_flushes() {
    for stack in [Stack::Sync, Stack::Async] {
        let image = formatted_image(16 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), Config { stack, ..test_config() });
        let a = OpenOptions::new().write(true).create(true).open(&fs, "/a").unwrap();
        a.write_at(&page(4), 0).unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();
        // An overwrite (in the tick of the last one, most likely: no metadata change),
        // written home by write-back without a flush, then fsync'd: the fsync finds
        // nothing dirty and nothing to commit, and must flush all the same.
        a.write_at(&page(5), 0).unwrap();
        fs.write_back().unwrap();
        let flushes = dev.stats().flushes;
        a.sync_all().unwrap();
        assert!(dev.stats().flushes > flushes, "{stack:?}: fsync returned without a flush");
        assert_eq!(content(&crashed(&base, &dev), "/a"), page(5), "{stack:?}");
        // The same for fdatasync, and for a sync of the whole file system.
        a.write_at(&page(6), 0).unwrap();
        fs.write_back().unwrap();
        a.sync_data().unwrap();
        assert_eq!(content(&crashed(&base, &dev), "/a"), page(6), "{stack:?}");
        a.write_at(&page(7), 0).unwrap();
        fs.write_back().unwrap();
        fs.sync().unwrap();
        assert_eq!(content(&crashed(&base, &dev), "/a"), page(7), "{stack:?}");
        drop(a);
        fs.unmount().unwrap();
    }
}

#[test]
fn a_file_grown_during_an_fsync_of_another_keeps_its_data_owed() {
    // A file whose new size a commit for another file's fsync stored without its
    // data keeps `data_meta_dirty`: the next fsync of any file writes that data.
    for stack in [Stack::Sync, Stack::Async] {
        let image = formatted_image(16 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), Config { stack, ..test_config() });
        let g = OpenOptions::new().write(true).create(true).open(&fs, "/g").unwrap();
        let f = OpenOptions::new().write(true).create(true).open(&fs, "/f").unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();
        std::thread::scope(|s| {
            s.spawn(|| {
                for p in 0..64 {
                    g.write_at(&page(p), p * 4096).unwrap();
                }
            });
            for p in 0..16 {
                f.write_at(&page(p), 0).unwrap();
                f.sync_all().unwrap();
            }
        });
        // Whatever the interleaving: after one more fsync of /f, every byte of /g
        // within the size a commit stored is its data, never a hole.
        f.write_at(&page(99), 0).unwrap();
        f.sync_all().unwrap();
        let after = crashed(&base, &dev);
        let got = content(&after, "/g");
        assert_eq!(got.len() % 4096, 0, "{stack:?}");
        for (p, chunk) in got.chunks(4096).enumerate() {
            assert_eq!(chunk, &page(p as u64)[..], "{stack:?}: /g page {p} of {}", got.len() / 4096);
        }
        drop((f, g));
        fs.unmount().unwrap();
    }
}

#[test]
fn a_commit_during_an_appending_write_never_stores_a_size_over_missing_data() {
    // One thread appends page after page; another commits again and again (fsyncs of
    // another file, syncs). At any crash point, every page of the appended file within
    // its recovered size holds its data: a write publishes its new size only after its
    // pages are dirty, and write-back keeps a page past the end of file dirty.
    for stack in [Stack::Sync, Stack::Async] {
        let image = formatted_image(32 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), Config { stack, ..test_config() });
        let g = OpenOptions::new().write(true).create(true).open(&fs, "/g").unwrap();
        let f = OpenOptions::new().write(true).create(true).open(&fs, "/f").unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for p in 0..1500 {
                    g.write_at(&page(p), p * 4096).unwrap();
                }
                done.store(true, std::sync::atomic::Ordering::Release);
            });
            let mut i = 0u64;
            // Commits all through the appends, and a few after them at least.
            while !done.load(std::sync::atomic::Ordering::Acquire) || i < 24 {
                f.write_at(&page(i), 0).unwrap();
                if i.is_multiple_of(2) {
                    f.sync_all().unwrap();
                } else {
                    fs.sync().unwrap();
                }
                i += 1;
            }
        });
        let log = dev.log();
        let flushes: Vec<usize> =
            (0..log.len()).filter(|i| matches!(log[*i], pwfs::device::sim::LogEntry::Flush)).collect();
        assert!(flushes.len() > 10, "{stack:?}: only {} flushes", flushes.len());
        for (n, at) in flushes.iter().enumerate().step_by((flushes.len() / 40).max(1)) {
            let img = pwfs::device::sim::crash_image(&base, &log, at + 1, n as u64);
            let (_d, after) = sim_fs(img, SimConfig::default(), test_config());
            let got = content_all(&after, "/g");
            for (p, chunk) in got.chunks(4096).enumerate() {
                let ok = chunk == &page(p as u64)[..chunk.len()];
                let zeros = chunk.iter().all(|b| *b == 0);
                assert!(
                    ok,
                    "{stack:?}, crash after entry {at}: /g page {p} of {} (all zeros: {zeros})",
                    got.len() / 4096
                );
            }
        }
        drop((f, g));
        fs.unmount().unwrap();
    }
}

fn content_all(fs: &Fs, path: &str) -> Vec<u8> {
    let f = OpenOptions::new().read(true).open(fs, path).unwrap();
    let size = f.metadata().unwrap().size;
    let mut buf = vec![0u8; size as usize];
    let n = f.read_at(&mut buf, 0).unwrap();
    assert_eq!(n as u64, size);
    buf
}

/// A device whose reads, while `held`, complete only when `release` is called: a test
/// can keep a reader waiting for the device.
struct HeldReads {
    inner: Arc<pwfs::device::mem::MemDevice>,
    /// (reads are held, reads waiting at the gate)
    gate: Arc<(std::sync::Mutex<(bool, usize)>, std::sync::Condvar)>,
}

impl HeldReads {
    fn hold(&self) {
        self.gate.0.lock().unwrap().0 = true;
    }

    fn release(&self) {
        self.gate.0.lock().unwrap().0 = false;
        self.gate.1.notify_all();
    }

    fn waiting(&self) -> usize {
        self.gate.0.lock().unwrap().1
    }

    /// Wait (up to 10 s) until a read waits at the gate.
    fn wait_for_a_read(&self, stack: Stack) {
        let t = std::time::Instant::now();
        while self.waiting() == 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "{stack:?}: the read never reached the device");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Page `p` of `f` read on a thread of its own: the bytes read.
fn read_page_on_a_thread(f: &Arc<pwfs::File>, p: u64) -> std::thread::JoinHandle<Vec<u8>> {
    let f = f.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        let n = f.read_at(&mut buf, p * 4096).unwrap();
        buf.truncate(n);
        buf
    })
}

/// A batch of reads that waits at the gate before it runs.
struct GatedBatch {
    inner: Arc<pwfs::device::mem::MemDevice>,
    ops: Option<Vec<pwfs::device::Op>>,
    gate: Arc<(std::sync::Mutex<(bool, usize)>, std::sync::Condvar)>,
}

impl pwfs::device::Completion for GatedBatch {
    fn poll(&mut self) -> bool {
        !self.gate.0.lock().unwrap().0
    }

    fn wait(&mut self) -> Vec<pwfs::device::Done> {
        let mut g = self.gate.0.lock().unwrap();
        g.1 += 1;
        self.gate.1.notify_all();
        while g.0 {
            g = self.gate.1.wait(g).unwrap();
        }
        g.1 -= 1;
        drop(g);
        pwfs::device::Device::submit(&*self.inner, self.ops.take().expect("waited for once"))
    }
}

impl pwfs::device::Device for HeldReads {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn name(&self) -> &'static str {
        "held-reads"
    }

    fn start(&self, ops: Vec<pwfs::device::Op>) -> pwfs::device::Pending {
        let reads = ops.iter().all(|o| o.kind == pwfs::device::OpKind::Read);
        if reads && self.gate.0.lock().unwrap().0 {
            let batch = GatedBatch { inner: self.inner.clone(), ops: Some(ops), gate: self.gate.clone() };
            return pwfs::device::Pending::new(Box::new(batch));
        }
        self.inner.start(ops)
    }
}

/// A reader waiting for the device does not hold up writers of the same file: the
/// wait is made without the file's lock (`Fs::read_pages`), under both stacks. A
/// write to another page and an overwrite of the page being read both return while
/// the read is still on the device; the read then returns the page as it was or as
/// the overwrite left it, never a mix (also for a second reader that found the page
/// on its way for the first), and a truncate waits for the page and leaves the read
/// with the data or nothing.
#[test]
fn a_reader_waiting_for_the_device_does_not_hold_up_writers() {
    for stack in [Stack::Async, Stack::Sync] {
        let image = formatted_image(16 * MIB, &MkfsOptions::default());
        let (dev, fs) = sim_fs(image, SimConfig::default(), test_config());
        let f = OpenOptions::new().write(true).create(true).open(&fs, "/f").unwrap();
        for p in 0..8 {
            f.write_at(&page(p), p * 4096).unwrap();
        }
        drop(f);
        fs.unmount().unwrap();
        let mem = Arc::new(pwfs::device::mem::MemDevice::from_vec(dev.snapshot()));
        let held = Arc::new(HeldReads { inner: mem, gate: Default::default() });
        // No readahead: the only read on the device is the reader's.
        let cfg = Config { stack, readahead_pages: 0, ..test_config() };
        let fs = Fs::mount(held.clone(), cfg).unwrap();
        let f = Arc::new(OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap());
        held.hold();
        let reader = read_page_on_a_thread(&f, 0);
        held.wait_for_a_read(stack);
        // A second reader of the page finds it on its way for the first, and waits
        // for it without the file's lock too.
        let second = read_page_on_a_thread(&f, 0);
        std::thread::sleep(Duration::from_millis(20));
        let writes = {
            let f = f.clone();
            std::thread::spawn(move || {
                f.write_at(&[9u8; 4096], 5 * 4096).unwrap();
                f.write_at(&[7u8; 4096], 0).unwrap();
            })
        };
        let t = std::time::Instant::now();
        while !writes.is_finished() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{stack:?}: a write of the file waited for another thread's read of the device"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        writes.join().unwrap();
        assert_eq!(held.waiting(), 1, "{stack:?}: the read is still on the device");
        held.release();
        for r in [reader, second] {
            let got = r.join().unwrap();
            assert!(got == page(0) || got == vec![7u8; 4096], "{stack:?}: the read saw half of a write");
        }
        let mut buf = vec![0u8; 4096];
        f.read_at(&mut buf, 5 * 4096).unwrap();
        assert_eq!(buf, vec![9u8; 4096]);

        // A truncate meets a read on the device: it waits for the page, and the read
        // returns the page or nothing.
        fs.evict_cache().unwrap();
        held.hold();
        let reader = read_page_on_a_thread(&f, 3);
        held.wait_for_a_read(stack);
        let truncate = {
            let f = f.clone();
            std::thread::spawn(move || f.set_len(0).unwrap())
        };
        std::thread::sleep(Duration::from_millis(20));
        assert!(!truncate.is_finished(), "{stack:?}: a truncate did not wait for a page being read");
        held.release();
        truncate.join().unwrap();
        let got = reader.join().unwrap();
        assert!(got.is_empty() || got == page(3), "{stack:?}: a read racing a truncate got {} bytes", got.len());
        assert_eq!(f.metadata().unwrap().size, 0);
        drop(f);
        fs.unmount().unwrap();
        fsck_clean(&*held.inner);
    }
}

/// Drop-behind: a sequential stream read for a caller that keeps what it reads (a FUSE
/// mount whose kernel caches file data) leaves the engine's cache behind it. The
/// first read of a stream, random reads, a caller that keeps nothing, and a page
/// holding a write not yet on disk stay cached, and every byte read is right.
#[test]
fn a_stream_read_into_another_cache_is_dropped_behind_it() {
    const PIECE: usize = 64 * 1024;
    let image = formatted_image(64 * MIB, &MkfsOptions::default());
    // A cache far larger than the files: nothing leaves it but by drop-behind.
    let (dev, fs) = sim_fs(image, SimConfig::default(), Config { cache_bytes: 64 * MIB, ..test_config() });
    let data: Vec<u8> = (0..2 * MIB as usize).map(|i| (i % 251) as u8).collect();
    fs.write_file("/kept", &data).unwrap();
    fs.write_file("/not", &data).unwrap();
    fs.sync().unwrap();
    fs.evict_cache().unwrap();
    let kept = fs.metadata("/kept").unwrap().ino;
    let not = fs.metadata("/not").unwrap().ino;
    // Page 40 of /kept written whole, not yet written back: dirty, up to date, no
    // patches (a partial write would leave patches, which keep a page too).
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/kept").unwrap();
    let page40 = vec![0xa5u8; 4096];
    f.write_at(&page40, 40 * 4096).unwrap();
    let mut want = data.clone();
    want[40 * 4096..41 * 4096].copy_from_slice(&page40);
    let behind = || fs.cache_dropped_behind();
    let read = |ino: u64, offset: u64, keep: bool| {
        let got =
            fs.read_with(ino, offset, PIECE, keep, |s| s.iter().flat_map(|s| s.iter().copied()).collect::<Vec<u8>>());
        got.unwrap()
    };

    // Random reads and the first read of a stream: nothing dropped.
    let before = behind();
    for offset in [5 * PIECE as u64, 0, 17 * PIECE as u64, 3 * PIECE as u64] {
        assert_eq!(read(kept, offset, true), want[offset as usize..offset as usize + PIECE]);
    }
    assert_eq!(behind(), before, "random reads keep their pages");

    // A stream: each read after the first continues the one before it.
    let before = behind();
    for i in 0..16u64 {
        let offset = 16 * PIECE as u64 + i * PIECE as u64;
        assert_eq!(read(kept, offset, true), want[offset as usize..offset as usize + PIECE]);
    }
    let dropped = behind() - before;
    // 15 continuing reads of 16 pages (pages 272..512), less any page another thread
    // (readahead) held at that moment.
    assert!(dropped > 12 * 16 && dropped <= 15 * 16, "{dropped} pages dropped behind the stream");
    // And stay dropped: readahead queued before the reader passed those pages does not
    // fetch them again once it runs. Read back in reverse (no stream, no readahead),
    // each piece comes from the device.
    fs.wait_readahead();
    for i in (17..32u64).rev() {
        let reads = dev.stats().reads;
        let offset = i * PIECE as u64;
        assert_eq!(read(kept, offset, false), want[offset as usize..offset as usize + PIECE]);
        assert!(dev.stats().reads > reads, "piece {i} was cached again after it was dropped behind");
    }

    // The same stream for a caller that keeps nothing.
    let before = behind();
    for i in 0..16u64 {
        let offset = i * PIECE as u64;
        assert_eq!(read(not, offset, false), data[offset as usize..offset as usize + PIECE]);
    }
    assert_eq!(behind(), before, "a caller without a cache of its own keeps the engine's");

    // Over the dirty page: streamed and dropped around, never lost.
    let before = behind();
    for i in 0..16u64 {
        let offset = i * PIECE as u64;
        assert_eq!(read(kept, offset, true), want[offset as usize..offset as usize + PIECE]);
    }
    assert!(behind() > before);
    fs.sync().unwrap();
    fs.evict_cache().unwrap();
    let mut back = vec![0u8; want.len()];
    assert_eq!(f.read_at(&mut back, 0).unwrap(), want.len());
    assert_eq!(back, want, "the write to the dirty page survived the stream");
    drop(f);
    drop(fs);
    fsck_clean(&*dev);
}
