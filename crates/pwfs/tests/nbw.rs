//! Non-blocking writes (mechanism 1): a partial write to a page that is not in memory
//! becomes a patch and returns without reading the device; reads covered by patches
//! need no I/O; fsync makes everything durable; a fetch that fails after the write
//! returned is reported by the next fsync.

mod common;
use common::*;
use pwfs::device::sim::{SimConfig, SimDevice};
use pwfs::{Config, FetchPolicy, Fs, MkfsOptions, OpenOptions};
use std::sync::Arc;

const POLICIES: [FetchPolicy; 4] =
    [FetchPolicy::Blocking, FetchPolicy::AsyncForeground, FetchPolicy::AsyncBackground, FetchPolicy::Lazy];

fn cold_file(policy: FetchPolicy) -> (Arc<SimDevice>, Fs, Vec<u8>) {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let fs = Fs::mount(dev.clone(), Config { fetch: policy, ..test_config() }).unwrap();
    let data: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    fs.write_file("/f", &data).unwrap();
    fs.evict_cache().unwrap();
    (dev, fs, data)
}

#[test]
fn partial_write_to_a_cold_page_does_not_read_under_lazy() {
    let (dev, fs, mut data) = cold_file(FetchPolicy::Lazy);
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    let reads = dev.stats().reads;
    f.write_at(b"patched!", 5000).unwrap();
    data[5000..5008].copy_from_slice(b"patched!");
    assert_eq!(dev.stats().reads, reads, "the write returned without reading");
    // A read wholly covered by the patch is served from it.
    let mut b = [0u8; 8];
    f.read_at(&mut b, 5000).unwrap();
    assert_eq!(&b, b"patched!");
    assert_eq!(dev.stats().reads, reads, "and so is a read of the patched bytes");
    let s = fs.nbw_stats();
    assert_eq!((s.patches_created, s.reads_from_patches), (1, 1));
    // A read that needs other bytes of the page fetches it and sees both.
    let mut b = vec![0u8; 100];
    f.read_at(&mut b, 4990).unwrap();
    assert_eq!(&b[..], &data[4990..5090]);
    assert!(dev.stats().reads > reads);
    f.sync_all().unwrap();
    drop(f);
    fs.unmount().unwrap();
    let (fs2_dev, fs2) = (dev.clone(), Fs::mount(dev.clone(), test_config()).unwrap());
    assert_eq!(fs2.read_file("/f").unwrap(), data);
    fs2.unmount().unwrap();
    fsck_clean(&*fs2_dev);
}

#[test]
fn overwriting_the_whole_page_cancels_the_fetch() {
    let (dev, fs, mut data) = cold_file(FetchPolicy::Lazy);
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    let reads = dev.stats().reads;
    f.write_at(&[7u8; 100], 8192 + 50).unwrap();
    f.write_at(&[8u8; 50], 8192 + 120).unwrap(); // overlaps: merged, later bytes win
    f.write_at(&[9u8; 4096], 8192).unwrap();
    data[8192..12288].fill(9);
    assert_eq!(dev.stats().reads, reads);
    let s = fs.nbw_stats();
    assert_eq!(s.fetches_avoided, 1);
    assert_eq!(s.patch_bytes, 0, "no patch memory left behind");
    f.sync_all().unwrap();
    assert_eq!(dev.stats().reads, reads, "fsync had nothing to fetch");
    assert_eq!(fs.read_file("/f").unwrap(), data);
}

#[test]
fn overlapping_patches_keep_the_last_writer() {
    for policy in POLICIES {
        let (_dev, fs, mut data) = cold_file(policy);
        let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
        let writes: [(u64, &[u8]); 5] =
            [(100, b"aaaaaaaa"), (104, b"bbbb"), (90, b"cccccccccccc"), (300, b"dd"), (101, b"e")];
        for (off, w) in writes {
            f.write_at(w, off).unwrap();
            data[off as usize..off as usize + w.len()].copy_from_slice(w);
        }
        assert_eq!(fs.read_file("/f").unwrap(), data, "{policy:?}");
        f.sync_all().unwrap();
        fs.evict_cache().unwrap();
        assert_eq!(fs.read_file("/f").unwrap(), data, "{policy:?} after write-back");
    }
}

#[test]
fn a_failed_fetch_after_the_write_returned_is_reported_by_fsync() {
    let (dev, fs, _) = cold_file(FetchPolicy::Lazy);
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    f.write_at(b"lost", 20_000).unwrap();
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    let e = f.sync_all().unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    dev.set_config(SimConfig::default());
    f.sync_all().unwrap();
    assert!(fs.poisoned().is_none(), "a failed read does not poison");
}

/// A write of a whole page that joins a fetch of that page in flight (as a patch)
/// needs none of its old data: when the read fails, the page is the write's, dirty,
/// and nothing is lost (it is how a bad sector gets rewritten). Before, the write was
/// dropped with the failed page and reported lost.
#[test]
fn a_whole_page_written_during_a_failing_fetch_of_it_is_kept() {
    let (dev, fs, mut data) = cold_file(FetchPolicy::Lazy);
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    f.write_at(&[7u8; 100], 8192).unwrap();
    // The fetch of that page (the fsync's) fails after a second; the whole-page write
    // comes while it is in flight.
    dev.set_config(SimConfig { read_fail: 1.0, latency: std::time::Duration::from_secs(1), ..Default::default() });
    let merged = fs.nbw_stats().patches_merged;
    std::thread::scope(|s| {
        let syncer = s.spawn(|| f.sync_all());
        std::thread::sleep(std::time::Duration::from_millis(250));
        f.write_at(&[9u8; 4096], 8192).unwrap();
        assert_eq!(fs.nbw_stats().patches_merged, merged + 1, "the write joined the fetch in flight");
        syncer.join().unwrap().unwrap();
    });
    dev.set_config(SimConfig::default());
    f.sync_all().unwrap();
    data[8192..12288].fill(9);
    assert_eq!(fs.read_file("/f").unwrap(), data);
    fs.evict_cache().unwrap();
    assert_eq!(fs.read_file("/f").unwrap(), data, "written back");
    assert_eq!(fs.nbw_stats().patch_bytes, 0);
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A front end that caches file data (the FUSE mount's kernel page cache) is told of
/// each page whose acknowledged writes were lost, so that it drops its copy.
#[test]
fn a_lost_patch_is_told_to_the_front_end_with_its_page() {
    let (dev, fs, _) = cold_file(FetchPolicy::Lazy);
    let told = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let t = told.clone();
    fs.on_lost_writes(move |ino, page| t.lock().unwrap().push((ino, page)));
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    f.write_at(b"lost", 20_000).unwrap();
    f.write_at(&[5u8; 4096], 8192).unwrap();
    assert!(told.lock().unwrap().is_empty());
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    assert_eq!(f.sync_all().unwrap_err().errno(), libc::EIO);
    let ino = fs.metadata("/f").unwrap().ino;
    assert_eq!(*told.lock().unwrap(), [(ino, 20_000 / 4096)], "the patched page only");
}

/// A write lost after it returned is reported (EIO) once to every handle open when it
/// was lost, at its fsync or its close, whichever comes first, and to a handle opened
/// after it while no handle has reported it (Linux's errseq since 4.16); once reported,
/// not to handles opened later.
#[test]
fn a_failed_fetch_is_reported_once_to_each_handle_open_then() {
    let (dev, fs, _) = cold_file(FetchPolicy::Lazy);
    let open = || OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    let (f, g) = (open(), open());
    f.write_at(b"lost", 20_000).unwrap();
    // Nothing is known to be lost yet: close neither waits nor reports.
    open().close().unwrap();
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    // A read the patch cannot serve makes the fetch happen (and fail).
    let mut buf = [0u8; 8];
    assert_eq!(f.read_at(&mut buf, 19_998).unwrap_err().errno(), libc::EIO);
    dev.set_config(SimConfig::default());
    // A handle that could not have written does not report at close.
    OpenOptions::new().read(true).open(&fs, "/f").unwrap().close().unwrap();
    // Opened after the loss, before anyone reported it: it reports it.
    assert_eq!(open().close().unwrap_err().errno(), libc::EIO, "close reports the lost write");
    // The handles open at the loss report it too, once each.
    assert_eq!(f.sync_all().unwrap_err().errno(), libc::EIO, "the writer's fsync");
    f.sync_all().unwrap();
    f.close().unwrap();
    assert_eq!(g.close().unwrap_err().errno(), libc::EIO, "the other handle's close");
    // Reported: not news to a handle opened now, nor to an fsync by number.
    let late = open();
    late.sync_all().unwrap();
    late.close().unwrap();
    fs.fsync(fs.metadata("/f").unwrap().ino, false).unwrap();
    assert!(fs.poisoned().is_none());
}

/// A loss is the file's, not its number's: a file deleted with a loss nobody was told
/// of takes the report with it, and the next file given that number syncs cleanly.
#[test]
fn a_lost_write_goes_with_its_deleted_file() {
    let (dev, fs, _) = cold_file(FetchPolicy::Lazy);
    let ino = fs.metadata("/f").unwrap().ino;
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    f.write_at(b"lost", 20_000).unwrap();
    dev.set_config(SimConfig { read_fail: 1.0, ..Default::default() });
    let mut buf = [0u8; 8];
    assert_eq!(f.read_at(&mut buf, 19_998).unwrap_err().errno(), libc::EIO);
    dev.set_config(SimConfig::default());
    drop(f);
    fs.remove_file("/f").unwrap();
    let g = fs.create("/g").unwrap();
    assert_eq!(g.ino(), ino, "the freed number is the next one handed out");
    g.write_at(b"fresh", 0).unwrap();
    g.sync_all().expect("the new file lost nothing");
    assert_eq!(fs.read_file("/g").unwrap(), b"fresh");
}

#[test]
fn patch_memory_is_bounded() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let config = Config { fetch: FetchPolicy::Lazy, patch_bytes: 1000, ..test_config() };
    let fs = Fs::mount(dev.clone(), config).unwrap();
    let data = vec![3u8; 64 * 1024];
    fs.write_file("/f", &data).unwrap();
    fs.evict_cache().unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    for i in 0..10u64 {
        f.write_at(&[1u8; 300], i * 4096 + 7).unwrap();
    }
    let s = fs.nbw_stats();
    assert!(s.patches_created <= 3 && s.patch_memory_fallbacks >= 7, "{s:?}");
    assert!(s.patch_bytes <= 1000);
    f.sync_all().unwrap();
    assert_eq!(fs.nbw_stats().patch_bytes, 0);
    assert_eq!(fs.nbw_stats().patched_pages, 0);
}

#[test]
fn truncate_clips_patches_and_stat_shows_the_size() {
    for policy in POLICIES {
        let (_dev, fs, mut data) = cold_file(policy);
        let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
        f.write_at(b"xyz", 30_000).unwrap();
        f.write_at(b"tail", 64 * 1024 + 10).unwrap(); // past EOF: no fetch, zero fill
        assert_eq!(f.metadata().unwrap().size, 64 * 1024 + 14);
        f.set_len(30_001).unwrap();
        data.truncate(30_001);
        data[30_000] = b'x';
        assert_eq!(fs.read_file("/f").unwrap(), data, "{policy:?}");
        f.sync_all().unwrap();
        assert_eq!(fs.nbw_stats().patch_bytes, 0, "{policy:?}");
        assert_eq!(fs.nbw_stats().patched_pages, 0, "{policy:?}");
    }
}

#[test]
fn readers_and_writers_on_the_same_pages_under_every_policy() {
    for policy in POLICIES {
        let (_dev, fs, _) = cold_file(policy);
        let threads: Vec<_> = (0..3u8)
            .map(|t| {
                let fs = fs.clone();
                std::thread::spawn(move || {
                    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
                    let mut buf = vec![0u8; 700];
                    for i in 0..200u64 {
                        // Thread t owns bytes [t*20000, t*20000+20000); other threads read anywhere.
                        let off = t as u64 * 20_000 + (i * 389) % 19_000;
                        let v = (i % 200) as u8 + t * 10;
                        f.write_at(&[v; 700], off).unwrap();
                        f.read_at(&mut buf, off).unwrap();
                        assert!(buf.iter().all(|b| *b == v), "{policy:?} thread {t} iteration {i}");
                        let mut other = vec![0u8; 5000];
                        f.read_at(&mut other, (i * 7919) % 60_000).unwrap();
                        if i % 50 == 0 {
                            fs.evict_cache().unwrap();
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|h| h.join().unwrap());
        fs.sync().unwrap();
        let s = fs.nbw_stats();
        assert_eq!((s.patch_bytes, s.patched_pages), (0, 0), "{policy:?}: accounting settles");
    }
}

/// The fetcher and readahead read without the inode lock: a truncate racing them waits
/// for the pages they are reading, and patch memory accounting still settles to zero.
/// Bytes below the smallest size the truncater ever sets are the writer's alone and
/// compared with a model; fsck checks the rest.
#[test]
fn truncate_racing_the_fetcher_settles() {
    const KEEP: usize = 20_000;
    for policy in [FetchPolicy::AsyncForeground, FetchPolicy::AsyncBackground, FetchPolicy::Lazy] {
        let (dev, fs, data) = cold_file(policy);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let truncater = {
            let (fs, stop) = (fs.clone(), stop.clone());
            std::thread::spawn(move || {
                let f = OpenOptions::new().write(true).open(&fs, "/f").unwrap();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Down to somewhere in [KEEP, 64 KiB), unaligned, and back up.
                    f.set_len(KEEP as u64 + (i * 7_777) % (65_536 - KEEP as u64)).unwrap();
                    f.set_len(65_536).unwrap();
                    if i.is_multiple_of(4) {
                        fs.evict_cache().unwrap();
                    }
                    i += 1;
                }
            })
        };
        let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
        let mut model = data[..KEEP].to_vec();
        for i in 0..5_000u64 {
            let off = (i * 4_099) % 64_000;
            let v = (i % 251) as u8;
            f.write_at(&[v; 600], off).unwrap();
            if (off as usize) < KEEP {
                model[off as usize..(off as usize + 600).min(KEEP)].fill(v);
            }
            if i.is_multiple_of(64) {
                fs.evict_cache().unwrap();
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        truncater.join().unwrap();
        f.sync_all().unwrap();
        let s = fs.nbw_stats();
        assert_eq!((s.patch_bytes, s.patched_pages), (0, 0), "{policy:?}: accounting settles");
        assert_eq!(&fs.read_file("/f").unwrap()[..KEEP], &model[..], "{policy:?}");
        drop(f);
        fs.unmount().unwrap();
        fsck_clean(&*dev);
    }
}

/// Async-FG as the paper has it: the writer resolves the block and starts the read
/// itself before it returns (the read is on the device at once); the fetcher thread
/// completes it. Writes that come while the read is in flight join it as patches
/// instead of waiting for it. Async-BG leaves both to the fetcher.
#[test]
fn async_fg_writer_starts_the_fetch_and_later_writes_join_it() {
    let (dev, fs, mut data) = cold_file(FetchPolicy::AsyncForeground);
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    // Reads now take 300 ms to complete: nothing below may wait for one.
    dev.set_config(SimConfig { latency: std::time::Duration::from_millis(300), ..SimConfig::default() });
    let reads = dev.stats().reads;
    f.write_at(b"first", 3 * 4096 + 10).unwrap();
    assert_eq!(dev.stats().reads, reads + 1, "the writer started the read of its page");
    f.write_at(b"second", 3 * 4096 + 100).unwrap();
    f.write_at(b"third", 3 * 4096 + 12).unwrap();
    let s = fs.nbw_stats();
    assert_eq!(s.patched_pages, 1, "one page waits for its data with patches");
    assert_eq!(s.patch_bytes, 5 + 6 + 5, "the later writes became patches of the page in flight");
    assert_eq!(dev.stats().reads, reads + 1, "and started no read of their own");
    for (off, b) in [(10usize, &b"first"[..]), (100, b"second"), (12, b"third")] {
        data[3 * 4096 + off..3 * 4096 + off + b.len()].copy_from_slice(b);
    }
    // A reader waits for the read and sees every write, in order.
    let mut page = vec![0u8; 4096];
    f.read_at(&mut page, 3 * 4096).unwrap();
    assert_eq!(&page[..], &data[3 * 4096..4 * 4096]);
    dev.set_config(SimConfig::default());
    f.sync_all().unwrap();
    let s = fs.nbw_stats();
    assert_eq!((s.patch_bytes, s.patched_pages), (0, 0));
    drop(f);
    fs.unmount().unwrap();
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/f").unwrap(), data);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// Dropping the last handle of a file system (no explicit unmount) while a read that
/// an Async-FG writer started is in flight completes that read and unmounts cleanly
/// (the final commit used to wait forever for the page).
#[test]
fn dropping_the_file_system_with_a_fetch_in_flight_unmounts() {
    let (dev, fs, mut data) = cold_file(FetchPolicy::AsyncForeground);
    dev.set_config(SimConfig { latency: std::time::Duration::from_millis(200), ..SimConfig::default() });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let f = OpenOptions::new().write(true).open(&fs, "/f").unwrap();
        f.write_at(b"in flight", 9000).unwrap();
        drop(f);
        drop(fs);
        let _ = tx.send(());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the drop hung");
    dev.set_config(SimConfig::default());
    data[9000..9009].copy_from_slice(b"in flight");
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/f").unwrap(), data);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// Pages holding only patches count as at least 2 KiB of the patch memory each, not
/// only the bytes of their patches: each takes a whole page when it is resolved (by
/// the next commit at the latest), so 16-byte patches within the patch memory were
/// millions of pages, gigabytes at the commit. Past the bound a partial write reads
/// its page first.
#[test]
fn pages_holding_only_patches_count_against_the_patch_memory() {
    let image = formatted_image(64 * MIB, &MkfsOptions::default());
    let dev = Arc::new(SimDevice::new(image, SimConfig::default()));
    let cache_pages = 256u64;
    let config = Config {
        fetch: FetchPolicy::Lazy,
        cache_bytes: cache_pages * 4096,
        patch_bytes: 256 << 10,
        writeback_interval: None,
        ..test_config()
    };
    let fs = Fs::mount(dev.clone(), config).unwrap();
    let pages = 4 * cache_pages;
    let data: Vec<u8> = (0..pages * 4096).map(|i| (i % 251) as u8).collect();
    fs.write_file("/f", &data).unwrap();
    fs.sync().unwrap();
    fs.evict_cache().unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
    let mut want = data.clone();
    for i in 0..pages {
        let at = (i * 4096 + 100) as usize;
        f.write_at(b"sixteen bytes!!!", at as u64).unwrap();
        want[at..at + 16].copy_from_slice(b"sixteen bytes!!!");
        let patched = fs.nbw_stats().patched_pages as u64;
        assert!(patched <= 128, "{patched} pages of 16-byte patches within 256 KiB of patch memory");
    }
    assert!(fs.nbw_stats().patch_memory_fallbacks > 0);
    f.sync_all().unwrap();
    assert_eq!(fs.read_file("/f").unwrap(), want);
    drop(f);
    fs.unmount().unwrap();
}

/// `Fs::read_with` (the FUSE read's reply straight from the cache) hands over the same
/// bytes as `read`: cached pages as slices of their own, pages served from patches
/// copied, holes as zeros, the end of file cut; under every fetch policy.
#[test]
fn read_with_hands_over_what_read_copies() {
    for policy in POLICIES {
        let (_dev, fs, mut data) = cold_file(policy);
        let f = OpenOptions::new().read(true).write(true).open(&fs, "/f").unwrap();
        let ino = f.ino();
        // Patches on cold pages (served from them where they cover a read), and a
        // hole past the old end.
        for (at, bytes) in [(5000usize, &b"patched!"[..]), (20_000, b"xyz"), (40_955, b"across a page edge")] {
            f.write_at(bytes, at as u64).unwrap();
            data[at..at + bytes.len()].copy_from_slice(bytes);
        }
        f.set_len(80 * 1024).unwrap();
        data.resize(80 * 1024, 0);
        let joined = |offset: u64, len: usize| {
            fs.read_with(ino, offset, len, false, |slices| {
                (slices.len(), slices.iter().flat_map(|s| s.iter().copied()).collect::<Vec<u8>>())
            })
            .unwrap()
        };
        if policy == FetchPolicy::Lazy {
            // Two pages only their patches hold (across a page edge): copied into one
            // slice, and each counted once as served from patches.
            let before = fs.nbw_stats().reads_from_patches;
            assert_eq!(joined(40_955, 18), (1, b"across a page edge".to_vec()));
            assert_eq!(fs.nbw_stats().reads_from_patches - before, 2);
        }
        let cases =
            [(5000, 8), (4990, 100), (20_000, 3), (0, 64 * 1024), (40_950, 30), (60_000, 20_000), (81_000, 9000)];
        for (offset, len) in cases {
            let (_, got) = joined(offset, len);
            let end = (offset as usize + len).min(data.len()).max(offset as usize);
            assert_eq!(got, data[offset as usize..end], "{policy:?}: {len} bytes at {offset}");
            let mut b = vec![0u8; len];
            let n = f.read_at(&mut b, offset).unwrap();
            assert_eq!(got, b[..n], "{policy:?}: read_with and read agree");
        }
        // Past the end: nothing, and the closure still answers.
        assert_eq!(joined(90_000, 10), (0, vec![]));
        // Cached pages go over as they are: one slice per page, no copy.
        // (A background fetch finishing late may hold a page for an instant: the read
        // is then copied, and tried again.)
        f.sync_all().unwrap();
        let slices = (0..100)
            .map(|_| {
                let (slices, got) = joined(100, 3 * 4096);
                assert_eq!(got, data[100..100 + 3 * 4096]);
                slices
            })
            .find(|&n| n != 1);
        assert_eq!(slices, Some(4), "{policy:?}: an unaligned read of 3 pages spans 4 cached pages");
        drop(f);
        fs.unmount().unwrap();
    }
}
