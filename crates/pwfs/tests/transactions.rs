//! Transactions are bounded by construction: whatever runs, the running transaction
//! never outgrows the journal, nothing acknowledged is lost, an operation checks its
//! name again after committing to make room, and a commit's I/O stalls no reader.

mod common;
use common::*;
use pwfs::device::mem::MemDevice;
use pwfs::device::sim::crash_image;
use pwfs::{Config, Fs, MkfsOptions, OpenOptions};
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// The chmod storm: thousands of setattrs, none of which used to commit, on an image
/// whose journal (256 blocks) is smaller than the inode table they dirty.
#[test]
fn a_chmod_of_every_inode_commits_as_it_goes_and_keeps_every_change() {
    let dev = Arc::new(MemDevice::new(64 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(4096), journal_blocks: None }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    let n = (fs.statfs().inodes_free) as usize;
    assert!(n >= 4094, "{n} free inodes");
    let n = 4094;
    let dirs = 8;
    for d in 0..dirs {
        fs.create_dir(format!("/d{d}"), 0o755).unwrap();
    }
    let path = |i: usize| format!("/d{}/f{i}", i % dirs);
    for i in 0..n - dirs {
        fs.create(path(i)).unwrap();
    }
    for i in 0..n - dirs {
        fs.set_permissions(path(i), 0o600 | (i as u32 & 0o7)).unwrap();
    }
    // Owners too: a second setattr of every inode in one run.
    for i in 0..n - dirs {
        fs.set_owner(path(i), Some(1000 + i as u32), None).unwrap();
    }
    assert_eq!(fs.poisoned(), None);
    fs.sync().unwrap();
    assert!(fs.journal_stats().commits > 10, "the storm committed as it went: {:?}", fs.journal_stats());
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    for i in 0..n - dirs {
        let md = fs.metadata(path(i)).unwrap();
        assert_eq!(md.permissions(), 0o600 | (i as u32 & 0o7), "{}", path(i));
        assert_eq!(md.uid, 1000 + i as u32, "{}", path(i));
    }
    fs.unmount().unwrap();
}

/// The same storm without an explicit sync: unmount commits what is left.
#[test]
fn a_storm_of_creates_and_chmods_survives_unmount_without_sync() {
    let dev = Arc::new(MemDevice::new(64 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(4096), journal_blocks: Some(48) }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    for i in 0..3000 {
        fs.create(format!("/f{i}")).unwrap();
        fs.set_permissions(format!("/f{i}"), 0o640).unwrap();
        fs.setxattr(fs.resolve(format!("/f{i}"), true).unwrap(), b"user.k", &[i as u8; 40], false, false).unwrap();
    }
    for i in (0..3000).step_by(3) {
        fs.remove_file(format!("/f{i}")).unwrap();
    }
    assert_eq!(fs.poisoned(), None);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    for i in 0..3000 {
        let md = fs.metadata(format!("/f{i}"));
        if i % 3 == 0 {
            assert_eq!(errno(md), libc::ENOENT);
            continue;
        }
        assert_eq!(md.unwrap().permissions(), 0o640);
        let ino = fs.resolve(format!("/f{i}"), true).unwrap();
        assert_eq!(fs.getxattr(ino, b"user.k").unwrap(), vec![i as u8; 40]);
    }
    fs.unmount().unwrap();
}

/// Deleting a file whose blocks lie in every bitmap block, with a journal barely
/// larger than the bitmap: its freeing is split over transactions as needed.
#[test]
fn deleting_big_fragmented_files_fits_a_small_journal() {
    let dev = Arc::new(MemDevice::new(512 * MIB));
    // 131072 blocks: 5 bitmap blocks; the smallest journal mkfs accepts.
    let min = 131072u64.div_ceil(32736) + 32;
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(256), journal_blocks: Some(min) }).unwrap();
    assert!(pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(256), journal_blocks: Some(min - 1) }).is_err());
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(256), journal_blocks: Some(min) }).unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    // Two files written in alternating 4 KiB pieces, interleaved on the device.
    let (a, b) = (fs.create("/a").unwrap(), fs.create("/b").unwrap());
    let page = vec![7u8; 4096];
    for i in 0..4000u64 {
        a.write_at(&page, i * 4096).unwrap();
        b.write_at(&page, i * 4096).unwrap();
        if i % 500 == 0 {
            fs.sync().unwrap();
        }
    }
    fs.sync().unwrap();
    // And a big one spanning bitmap blocks.
    let c = fs.create("/c").unwrap();
    let chunk = vec![1u8; 1 << 20];
    for i in 0..300u64 {
        c.write_at(&chunk, i << 20).unwrap();
    }
    drop((a, b, c));
    fs.sync().unwrap();
    fs.remove_file("/a").unwrap();
    fs.remove_file("/c").unwrap();
    fs.set_len("/b", 5).unwrap();
    fs.sync().unwrap();
    assert_eq!(fs.poisoned(), None);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/b").unwrap(), vec![7u8; 5]);
    fs.unmount().unwrap();
}

/// Several creators of one name while the inodes are used up and only a commit
/// frees some: exactly one of them gets the name.
#[test]
fn creators_of_one_name_near_enospc_get_it_once() {
    for round in 0..40 {
        let dev = Arc::new(MemDevice::new(16 * MIB));
        pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(32), journal_blocks: None }).unwrap();
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        let mut i = 0;
        while fs.create(format!("/f{i}")).is_ok() {
            i += 1;
        }
        assert!(i >= 8, "created {i}");
        // Freed by the next commit only.
        for k in 0..4 {
            fs.remove_file(format!("/f{k}")).unwrap();
        }
        let threads = 4;
        let barrier = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (fs, barrier) = (fs.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&fs, "/race")
                        .map(|_| ())
                        .map_err(|e| e.errno())
                })
            })
            .collect();
        let results: Vec<Result<(), i32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let won = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(won, 1, "round {round}: {results:?}");
        assert!(results.iter().all(|r| matches!(r, Ok(()) | Err(libc::EEXIST))), "round {round}: {results:?}");
        assert_eq!(fs.read_dir("/").unwrap().iter().filter(|e| e.name == b"race").count(), 1);
        fs.unmount().unwrap();
        fsck_clean(&*dev);
        let fs = Fs::mount(dev.clone(), test_config()).unwrap();
        fs.metadata("/race").unwrap();
        fs.unmount().unwrap();
    }
}

/// A commit in the middle of its I/O (its flush held back) stalls neither lookups,
/// getattrs and cached reads nor metadata changes that fit the running transaction.
#[test]
fn a_commit_in_flight_stalls_no_reader() {
    let image = formatted_image(32 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, Default::default(), Config { writeback_interval: None, ..test_config() });
    fs.create_dir("/d", 0o755).unwrap();
    fs.write_file("/d/cached", &[5u8; 10000]).unwrap();
    fs.sync().unwrap();
    let mut buf = vec![0u8; 10000];
    let f = OpenOptions::new().read(true).open(&fs, "/d/cached").unwrap();
    f.read_at(&mut buf, 0).unwrap();
    // Something for the commit to log.
    fs.create("/d/new").unwrap();
    dev.hold_flushes();
    let committer = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.sync())
    };
    while dev.flushes_held() == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = {
        let fs = fs.clone();
        std::thread::spawn(move || {
            for i in 0..20 {
                let md = fs.metadata("/d/cached").unwrap();
                assert_eq!(md.size, 10000);
                let mut buf = vec![0u8; 10000];
                let f = OpenOptions::new().read(true).open(&fs, "/d/cached").unwrap();
                assert_eq!(f.read_at(&mut buf, 0).unwrap(), 10000);
                assert_eq!(buf, vec![5u8; 10000]);
                fs.set_permissions("/d/cached", 0o600 + i % 8).unwrap();
                fs.create(format!("/d/during{i}")).unwrap();
                fs.read_dir("/d").unwrap();
            }
            tx.send(()).unwrap();
        })
    };
    let done = rx.recv_timeout(Duration::from_secs(30));
    let still_held = dev.flushes_held();
    dev.release_flushes();
    worker.join().unwrap();
    committer.join().unwrap().unwrap();
    assert!(done.is_ok(), "readers stalled behind a commit's flush");
    assert!(still_held > 0, "the commit was in flight all along");
    fs.sync().unwrap();
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// Run `f` on a thread; a hang fails the test instead of hanging it.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("{what} hung"))
}

/// A panic inside a commit (here the device layer, as the journal is written, with
/// the commit's data writes done) poisons the file system and leaves no page on loan
/// to write-back: a read of the pages being written answers (data or EIO) instead of
/// waiting for good, and the file system can be unmounted.
#[test]
fn a_panic_in_a_commit_leaves_no_page_waiting() {
    use pwfs::device::{Device, Op, OpKind, Pending};
    use std::sync::atomic::{AtomicBool, Ordering};
    struct PanicOnJournal {
        inner: Arc<MemDevice>,
        armed: AtomicBool,
        journal: std::ops::Range<u64>,
    }
    impl Device for PanicOnJournal {
        fn len(&self) -> u64 {
            self.inner.len()
        }
        fn name(&self) -> &'static str {
            "panic-on-journal"
        }
        fn start(&self, ops: Vec<Op>) -> Pending {
            let journal =
                |o: &Op| matches!(o.kind, OpKind::Write | OpKind::WriteFua) && self.journal.contains(&o.offset);
            if self.armed.load(Ordering::SeqCst) && ops.iter().any(journal) {
                panic!("test: the device layer fails as the journal is written");
            }
            self.inner.start(ops)
        }
    }
    let mem = Arc::new(MemDevice::new(32 * MIB));
    let sb = pwfs::mkfs(&*mem, &MkfsOptions::default()).unwrap();
    let dev = Arc::new(PanicOnJournal {
        inner: mem,
        armed: AtomicBool::new(false),
        journal: sb.journal_start * 4096..(sb.journal_start + sb.journal_blocks) * 4096,
    });
    let fs = Fs::mount(dev.clone(), Config { writeback_interval: None, ..test_config() }).unwrap();
    let f = fs.create("/f").unwrap();
    f.write_all_at(&vec![7u8; 8 * 4096], 0).unwrap();
    dev.armed.store(true, Ordering::SeqCst);
    // A commit of everything (not an fsync, which writes its file's pages back before
    // it commits): the data writes are in flight as the journal is started.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fs.sync())).is_err();
    assert!(panicked, "the commit met the panicking device");
    assert!(fs.poisoned().is_some(), "a panic in a commit poisons the file system");
    let fs2 = fs.clone();
    let read = within("a read of pages written back when the commit panicked", move || fs2.read_file("/f"));
    assert!(matches!(&read, Ok(d) if *d == vec![7u8; 8 * 4096]) || errno(read.clone()) == libc::EIO, "{read:?}");
    drop(f);
    dev.armed.store(false, Ordering::SeqCst);
    let _ = within("unmount", move || fs.unmount());
}

/// One write larger than the journal could admit at once (a 64 MiB write reserves
/// 16,384 pages) goes in pieces instead of failing with ENOSPC.
#[test]
fn a_write_larger_than_one_transaction_succeeds_in_pieces() {
    let dev = Arc::new(MemDevice::new(128 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(256), journal_blocks: Some(34) }).unwrap();
    let fs = Fs::mount(dev.clone(), Config { cache_bytes: 16 * MIB, ..test_config() }).unwrap();
    let data: Vec<u8> = (0..64 * MIB as usize).map(|i| (i / 4096 % 251) as u8).collect();
    let f = fs.create("/big").unwrap();
    f.write_at(&data, 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert!(fs.read_file("/big").unwrap() == data);
    fs.unmount().unwrap();
}

/// A truncate to an unaligned size whose last page is in a hole allocates nothing (it
/// used to write that page of zeros to a block it never reserved).
#[test]
fn truncating_into_a_hole_allocates_nothing() {
    let (dev, fs) = mem_fs(32 * MIB);
    let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/sparse").unwrap();
    f.write_at(b"tail", 1 << 20).unwrap();
    fs.sync().unwrap();
    let before = fs.statfs().blocks_free;
    f.set_len(5000).unwrap();
    fs.sync().unwrap();
    assert_eq!(f.metadata().unwrap().blocks, 0, "no block for the hole");
    assert_eq!(fs.statfs().blocks_free, before + 1, "the data block was freed, nothing allocated");
    let mut b = vec![1u8; 5000];
    assert_eq!(f.read_at(&mut b, 0).unwrap(), 5000);
    assert!(b.iter().all(|x| *x == 0));
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A thread committing in a loop (`Fs::sync`) until stopped.
struct Syncer(Arc<std::sync::atomic::AtomicBool>, std::thread::JoinHandle<()>);

impl Syncer {
    fn start(fs: &Fs) -> Syncer {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (fs, flag) = (fs.clone(), stop.clone());
        Syncer(
            stop,
            std::thread::spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    fs.sync().unwrap();
                }
            }),
        )
    }

    fn stop(self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        self.1.join().unwrap();
    }
}

/// Truncates of fragmented files (extent chains) race commits from another thread:
/// the size and the unmapping are one change, so no commit logs a half-done truncate
/// (it used to poison the file system, or leave freed blocks mapped).
#[test]
fn truncates_of_fragmented_files_race_commits() {
    let (dev, fs) = mem_fs(64 * MIB);
    let syncer = Syncer::start(&fs);
    for round in 0..6u64 {
        let (a, b) = (fs.create("/a").unwrap(), fs.create("/b").unwrap());
        // Interleaved pages: hundreds of extents each, chains of two blocks.
        for i in 0..600u64 {
            a.write_at(&[round as u8 + 1; 4096], i * 4096).unwrap();
            b.write_at(&[round as u8 + 2; 4096], i * 4096).unwrap();
            if i % 100 == 0 {
                fs.sync().unwrap();
            }
        }
        fs.sync().unwrap();
        a.set_len(7 * 4096 + 5).unwrap();
        b.set_len(0).unwrap();
        assert_eq!(fs.poisoned(), None, "round {round}");
        drop((a, b));
        fs.remove_file("/a").unwrap();
        fs.remove_file("/b").unwrap();
    }
    syncer.stop();
    assert_eq!(fs.poisoned(), None);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A write whose first page cannot be read fails; the pages after it that it had put
/// in the cache do not stay there unfilled (readers, truncate and commits used to wait
/// for them forever), and their reservations are released.
#[test]
fn a_failed_write_leaves_no_page_waiting() {
    use pwfs::device::sim::SimConfig;
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let config = Config { fetch: pwfs::FetchPolicy::Blocking, ..test_config() };
    let (dev, fs) = sim_fs(image, SimConfig::default(), config);
    fs.write_file("/f", &[3u8; 8192]).unwrap();
    fs.evict_cache().unwrap();
    let free = fs.statfs().blocks_available;
    dev.set_config(SimConfig { read_fail: 1.0, ..SimConfig::default() });
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    // Page 0 needs a read (partial write), pages 1.. are new past EOF after page 1.
    assert_eq!(errno(f.write_at(&[9u8; 20000], 100)), libc::EIO);
    dev.set_config(SimConfig::default());
    let fs2 = fs.clone();
    within("a read after the failed write", move || {
        let f = OpenOptions::new().read(true).open(&fs2, "/f").unwrap();
        let mut b = vec![0u8; 8192];
        f.read_at(&mut b, 0).unwrap();
        b
    });
    let fs2 = fs.clone();
    within("sync and truncate after the failed write", move || {
        fs2.sync().unwrap();
        fs2.set_len("/f", 0).unwrap();
        fs2.sync().unwrap();
    });
    assert!(fs.statfs().blocks_available >= free, "no reservation leaked");
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A delete frees the inode at once (as ext4's last iput does), not at the next
/// commit; an unlinked file that is still open keeps its inode and data until its last
/// handle goes, and is freed then.
#[test]
fn a_delete_frees_its_inode_at_once_and_an_open_file_at_its_last_close() {
    let (dev, fs) = mem_fs(64 * MIB);
    let before = fs.statfs().inodes_free;
    let commits = fs.journal_stats().commits;
    fs.write_file("/a", &[7u8; 100_000]).unwrap();
    assert_eq!(fs.statfs().inodes_free, before - 1);
    fs.remove_file("/a").unwrap();
    assert_eq!(fs.statfs().inodes_free, before, "freed by the unlink itself");
    assert_eq!(fs.journal_stats().commits, commits, "no commit was needed for it");

    let f = OpenOptions::new().read(true).write(true).create(true).open(&fs, "/b").unwrap();
    f.write_at(&[9u8; 5000], 0).unwrap();
    fs.remove_file("/b").unwrap();
    assert_eq!(fs.statfs().inodes_free, before - 1, "held by its open handle");
    let mut buf = [0u8; 5000];
    assert_eq!(f.read_at(&mut buf, 0).unwrap(), 5000);
    assert!(buf.iter().all(|b| *b == 9));
    drop(f);
    assert_eq!(fs.statfs().inodes_free, before, "freed by its last close");
    assert_eq!(errno(fs.metadata("/b")), libc::ENOENT);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// An unlinked file whose freeing is too big for its last close (left to the commit,
/// its pages dropped at once) cannot be opened again by its number: it is deleted, as
/// on ext4 after the last reference. Before, it could, and read what its blocks held
/// at home instead of what was fsync'd (a block carried in the journal is only there).
#[test]
fn a_deleted_file_left_to_the_commit_cannot_be_reopened_by_number() {
    let dev = Arc::new(MemDevice::new(512 * MIB));
    let min = 131072u64.div_ceil(32736) + 32;
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(256), journal_blocks: Some(min) }).unwrap();
    let fs = Fs::mount(dev.clone(), Config { writeback_interval: None, ..test_config() }).unwrap();
    // A file of 4,000 extents (interleaved with another on the device): freeing it
    // takes more than a quarter of this journal.
    let (a, b) = (fs.create("/a").unwrap(), fs.create("/b").unwrap());
    let page = vec![7u8; 4096];
    for i in 0..4000u64 {
        a.write_at(&page, i * 8192).unwrap();
        b.write_at(&page, i * 8192).unwrap();
        if i % 500 == 0 {
            fs.sync().unwrap();
        }
    }
    fs.sync().unwrap();
    drop(b);
    let ino = a.ino();
    let before = fs.statfs().inodes_free;
    fs.remove_file("/a").unwrap();
    a.write_at(b"fsync'd", 0).unwrap();
    a.sync_all().unwrap();
    drop(a);
    assert_eq!(fs.statfs().inodes_free, before, "left to the commit, not freed at the last close");
    assert_eq!(errno(fs.open_ino_file(ino, true, false, false)), libc::ENOENT);
    assert_eq!(errno(fs.open_ino(ino)), libc::ENOENT);
    fs.sync().unwrap();
    assert_eq!(fs.statfs().inodes_free, before + 1, "freed by the commit");
    assert_eq!(fs.poisoned(), None);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// With the write-back thread committing in the background (the default), two
/// threads creating, looking up and deleting files in their own directories on a
/// small journal lose nothing and leave a clean image; lookups answered from the
/// directory index agree with the namespace throughout.
#[test]
fn background_commits_under_creates_and_deletes_from_two_threads() {
    let dev = Arc::new(MemDevice::new(64 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions { inodes: Some(2048), journal_blocks: Some(64) }).unwrap();
    let config = Config { writeback_interval: Some(Duration::from_millis(20)), ..test_config() };
    let fs = Fs::mount(dev.clone(), config.clone()).unwrap();
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let fs = fs.clone();
            std::thread::spawn(move || {
                fs.create_dir(format!("/t{t}"), 0o755).unwrap();
                for i in 0..3000u32 {
                    let p = format!("/t{t}/f{i}");
                    fs.write_file(&p, &i.to_le_bytes()).unwrap();
                    assert_eq!(fs.metadata(&p).unwrap().size, 4);
                    if i % 3 != 0 {
                        fs.remove_file(&p).unwrap();
                        assert_eq!(errno(fs.metadata(&p)), libc::ENOENT);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(fs.poisoned(), None);
    assert!(fs.journal_stats().commits > 2, "{:?}", fs.journal_stats());
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), config).unwrap();
    for t in 0..2 {
        let names = fs.read_dir(format!("/t{t}")).unwrap();
        assert_eq!(names.len(), 1000, "thread {t}");
        for i in (0..3000u32).step_by(3) {
            assert_eq!(fs.read_file(format!("/t{t}/f{i}")).unwrap(), i.to_le_bytes());
        }
    }
    fs.unmount().unwrap();
}

/// Group commit: fsyncs that arrive while a commit is in flight wait for it, then
/// share one more commit instead of one each; every fsync'd byte is durable.
#[test]
fn fsyncs_during_a_commit_share_the_next_one() {
    let image = formatted_image(32 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, Default::default(), Config { writeback_interval: None, ..test_config() });
    fs.write_file("/busy", &[1u8; 64 * 1024]).unwrap();
    fs.sync().unwrap();
    // Something for the held commit to log.
    fs.create("/first").unwrap();
    let base = dev.start_recording();
    // (Read now: the journal's counters wait for a commit in flight.)
    let before = fs.journal_stats().commits;
    dev.hold_flushes();
    let committer = {
        let fs = fs.clone();
        std::thread::spawn(move || fs.sync())
    };
    while dev.flushes_held() == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let n = 8;
    let started = Arc::new(Barrier::new(n + 1));
    let fsyncers: Vec<_> = (0..n)
        .map(|i| {
            let (fs, started) = (fs.clone(), started.clone());
            std::thread::spawn(move || {
                let f = OpenOptions::new().write(true).create(true).open(&fs, format!("/f{i}")).unwrap();
                f.write_at(&[i as u8; 3000], 0).unwrap();
                started.wait();
                f.sync_all().unwrap();
            })
        })
        .collect();
    // Meanwhile another writer keeps dirtying a file it never syncs: an fsync that
    // committed on its own would write and flush that again each time.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let (fs, stop) = (fs.clone(), stop.clone());
        std::thread::spawn(move || {
            let f = OpenOptions::new().write(true).open(&fs, "/busy").unwrap();
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                f.write_at(&[i as u8; 4096], (i % 16) * 4096).unwrap();
                i += 1;
                std::thread::yield_now();
            }
        })
    };
    started.wait();
    // Let every fsync reach the commit lock behind the held commit.
    std::thread::sleep(Duration::from_millis(200));
    let flushes = dev.stats().flushes;
    dev.release_flushes();
    committer.join().unwrap().unwrap();
    for t in fsyncers {
        t.join().unwrap();
    }
    let flushes = dev.stats().flushes - flushes;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.join().unwrap();
    let commits = fs.journal_stats().commits - before;
    // The held one finishes; the eight fsyncs share one (two if one of them came late):
    // two flushes each (journal, commit block), and one to write back data.
    assert!(commits <= 3, "{commits} commits for {n} fsyncs during one commit");
    assert!(flushes <= 7, "{flushes} flushes for {n} fsyncs during one commit");
    // A power cut now: whatever was not flushed may be lost, what was fsync'd may not.
    let log = dev.log();
    let (_dev, fs) = sim_fs(crash_image(&base, &log, log.len(), 7), Default::default(), test_config());
    for i in 0..n {
        assert_eq!(fs.read_file(format!("/f{i}")).unwrap(), vec![i as u8; 3000], "/f{i}");
    }
    fs.unmount().unwrap();
}

/// Space freed by deletes comes back while writers keep writing: threads that each
/// write files of an eighth of the image and delete them again (closed first, or held
/// open across the unlink), many times the image's size in all, never see ENOSPC.
/// (The race that once needed more than one commit to find the space, 50 threads of
/// `bench fuse`'s file server, is not reproduced here deterministically.)
#[test]
fn deletes_and_writes_in_a_loop_never_run_out_of_space() {
    let dev = Arc::new(MemDevice::new(64 * MIB));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    let config =
        Config { cache_bytes: 8 * MIB, writeback_interval: Some(Duration::from_secs(5)), ..Default::default() };
    let fs = Fs::mount(dev.clone(), config).unwrap();
    let chunk = vec![7u8; 256 * 1024];
    std::thread::scope(|s| {
        for t in 0..4 {
            let (fs, chunk) = (fs.clone(), &chunk);
            s.spawn(move || {
                for round in 0..24 {
                    let path = format!("/t{t}-{round}");
                    // Held open across the unlink on odd rounds: freed at the close.
                    let f = OpenOptions::new().write(true).create(true).open(&fs, &path).unwrap();
                    for i in 0..24 {
                        f.write_at(chunk, i * chunk.len() as u64).unwrap_or_else(|e| panic!("{path}: {e}"));
                    }
                    if round % 2 == 1 {
                        fs.remove_file(&path).unwrap();
                        drop(f);
                    } else {
                        drop(f);
                        fs.remove_file(&path).unwrap();
                    }
                }
            });
        }
    });
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A truncate into the middle of a block while commits write back pages: the kept
/// part of the tail block survives a later fsync, from the cache and from the device.
/// (The race this guards — write-back writing the zeroed tail page in place into the
/// block the truncate then unmapped, the page left clean and never written again — is
/// closed by construction: the truncate holds the commit lock from the drop to the
/// change. Its window is too narrow for this loop to hit reliably without that.)
#[test]
fn a_truncate_racing_write_back_keeps_the_tail() {
    let (dev, fs) = mem_fs(64 * MIB);
    let syncer = Syncer::start(&fs);
    for round in 0..300u32 {
        let data: Vec<u8> = (0..3 * 4096u32).map(|k| (k / 7 + round) as u8).collect();
        let f = fs.create("/t").unwrap();
        f.write_at(&data, 0).unwrap();
        f.sync_all().unwrap();
        // The tail page dirty again, so that write-back has it to write.
        f.write_at(&data[4096..4200], 4096).unwrap();
        let size = 4096 + 1000 + u64::from(round % 3000);
        f.set_len(size).unwrap();
        f.sync_all().unwrap();
        fs.evict_cache().unwrap();
        let got = fs.read_file("/t").unwrap();
        assert_eq!(got.len() as u64, size, "round {round}");
        assert!(got == data[..size as usize], "round {round}: the kept tail differs");
        drop(f);
        fs.remove_file("/t").unwrap();
    }
    syncer.stop();
    assert_eq!(fs.poisoned(), None);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// fdatasync of a directory makes the names made in it durable, a new directory block
/// included: they live in the journal, so it commits.
#[test]
fn fdatasync_of_a_directory_commits_its_names() {
    let (dev, fs) = mem_fs(64 * MIB);
    fs.create_dir("/d", 0o755).unwrap();
    fs.sync().unwrap();
    let d = fs.metadata("/d").unwrap().ino;
    for i in 0..150 {
        drop(fs.create(format!("/d/name-{i:04}")).unwrap());
    }
    fs.fsync(d, true).unwrap();
    fs.go_down(pwfs::GoingDown::NoLogFlush).unwrap();
    drop(fs);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_dir("/d").unwrap().len(), 150);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A stream of writes that keeps the write-back thread busy freeing the cache (each
/// write over the pressure mark wakes it early) does not hold off the interval's commit:
/// what a crash can lose stays bounded by the commit interval.
#[test]
fn a_stream_of_writes_does_not_hold_off_the_interval_commit() {
    let dev = Arc::new(pwfs::device::mem::MemDevice::new(256 * MIB));
    pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
    let every = std::time::Duration::from_millis(20);
    let config = pwfs::Config { cache_bytes: 64 * 4096, writeback_interval: Some(every), ..test_config() };
    let fs = Fs::mount(dev, config).unwrap();
    let f = pwfs::OpenOptions::new().write(true).create_new(true).open(&fs, "/stream").unwrap();
    let chunk = vec![7u8; 64 << 10];
    let before = fs.journal_stats().commits;
    let start = std::time::Instant::now();
    let mut at = 0u64;
    // Stream until five interval commits have happened, or give up after a deadline far
    // beyond five intervals (a loaded CI machine stretches each commit; a stream that
    // holds the commit off stretches it forever).
    let deadline = std::time::Duration::from_secs(30);
    let mut commits = 0;
    while commits < 5 && start.elapsed() < deadline {
        f.write_at(&chunk, at).unwrap();
        // Over 32 MiB again and again (the image would fill otherwise).
        at = (at + chunk.len() as u64) % (32 * MIB);
        commits = fs.journal_stats().commits - before;
    }
    assert!(commits >= 5, "{commits} commits in {:?} of streaming with a {every:?} interval", start.elapsed());
    drop(f);
    fs.unmount().unwrap();
}
