//! fallocate(2) in every mode and lseek's SEEK_DATA/SEEK_HOLE: random sequences
//! against a byte model, through commits and remounts, fsck-checked; preallocated
//! blocks never show old contents, even after a power cut; errors as Linux gives them.

mod common;
use common::*;
use pwfs::device::sim::crash_image;
use pwfs::fs::{
    FALLOC_FL_COLLAPSE_RANGE as COLLAPSE, FALLOC_FL_INSERT_RANGE as INSERT, FALLOC_FL_KEEP_SIZE as KEEP,
    FALLOC_FL_PUNCH_HOLE as PUNCH, FALLOC_FL_ZERO_RANGE as ZERO,
};
use pwfs::{Fs, MkfsOptions, OpenOptions};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

const B: u64 = 4096;

fn open_rw(fs: &Fs, path: &str) -> pwfs::File {
    OpenOptions::new().read(true).write(true).create(true).open(fs, path).unwrap()
}

fn read_all(f: &pwfs::File) -> Vec<u8> {
    let size = f.metadata().unwrap().size as usize;
    let mut buf = vec![0u8; size];
    let mut at = 0;
    while at < size {
        let n = f.read_at(&mut buf[at..], at as u64).unwrap();
        assert!(n > 0, "short read at {at} of {size}");
        at += n;
    }
    buf
}

/// SEEK_DATA/SEEK_HOLE agree with the contents: no byte outside the data they
/// report is non-zero, holes and data alternate, and the end of the file is a hole.
fn check_seek(f: &pwfs::File, model: &[u8], what: &str) {
    let size = model.len() as u64;
    let mut pos = 0u64;
    while pos < size {
        let data = match f.seek_hole_data(pos, false) {
            Ok(d) => d,
            Err(e) => {
                assert_eq!(e.errno(), libc::ENXIO, "{what}: SEEK_DATA at {pos}");
                size
            }
        };
        assert!(data >= pos && data <= size, "{what}: SEEK_DATA {pos} -> {data} (size {size})");
        let zeros = &model[pos as usize..data as usize];
        assert!(zeros.iter().all(|b| *b == 0), "{what}: non-zero byte in the hole {pos}..{data}");
        if data == size {
            break;
        }
        let hole = f.seek_hole_data(data, true).unwrap();
        assert!(hole > data && hole <= size, "{what}: SEEK_HOLE {data} -> {hole} (size {size})");
        pos = hole;
    }
    assert_eq!(errno(f.seek_hole_data(size, false)), libc::ENXIO, "{what}: SEEK_DATA at the end");
    assert_eq!(errno(f.seek_hole_data(size, true)), libc::ENXIO, "{what}: SEEK_HOLE at the end");
}

/// What Linux does to the bytes (and the size) for one fallocate call.
fn apply(model: &mut Vec<u8>, mode: u32, off: u64, len: u64) {
    let (o, e) = (off as usize, (off + len) as usize);
    let keep = mode & KEEP != 0;
    match mode & !KEEP {
        0 => {
            if !keep && e > model.len() {
                model.resize(e, 0);
            }
        }
        PUNCH => {
            let e = e.min(model.len());
            if o < e {
                model[o..e].fill(0);
            }
        }
        ZERO => {
            if !keep && e > model.len() {
                model.resize(e, 0);
            }
            let e = e.min(model.len());
            if o < e {
                model[o..e].fill(0);
            }
        }
        COLLAPSE => {
            model.drain(o..e);
        }
        INSERT => {
            let tail = model.split_off(o);
            model.resize(e, 0);
            model.extend(tail);
        }
        _ => unreachable!(),
    }
}

fn random_sequence(seed: u64) {
    let (dev, fs) = mem_fs(64 * MIB);
    let mut fs = fs;
    let mut f = open_rw(&fs, "/f");
    // A second file interleaves its allocations with the first's.
    let mut g = open_rw(&fs, "/g");
    let mut model: Vec<u8> = Vec::new();
    let mut rng = SmallRng::seed_from_u64(seed);
    let max = 600 * 1024u64;
    let mut log: Vec<String> = Vec::new();
    for step in 0..300u64 {
        let what = format!("seed {seed} step {step}");
        let size = model.len() as u64;
        // Both ends on block boundaries, the start only (a range that may end inside
        // its first block), or neither.
        let shape = rng.gen_range(0..10);
        let mut off = rng.gen_range(0..max);
        let mut len: u64 = rng.gen_range(1..64 * 1024);
        if shape < 6 {
            off = off / B * B;
        }
        if shape < 4 {
            len = len.div_ceil(B) * B;
        } else if shape < 6 && rng.gen_bool(0.5) {
            len = rng.gen_range(1..B);
        }
        let pick = rng.gen_range(0..100);
        log.push(format!("{step}: op {pick} off {off} len {len} size {size}"));
        match pick {
            0..=29 => {
                let data: Vec<u8> = (0..len).map(|i| ((step * 31 + i) % 251) as u8 + 1).collect();
                f.write_at(&data, off).unwrap();
                if off + len > size {
                    model.resize((off + len) as usize, 0);
                }
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
                g.write_at(&data[..(len as usize).min(5000)], off / 2).unwrap();
            }
            30..=39 => {
                let mode = if rng.gen_bool(0.5) { KEEP } else { 0 };
                f.allocate(mode, off, len).unwrap();
                apply(&mut model, mode, off, len);
            }
            40..=54 => {
                f.allocate(PUNCH | KEEP, off, len).unwrap();
                apply(&mut model, PUNCH | KEEP, off, len);
            }
            55..=64 => {
                let mode = if rng.gen_bool(0.5) { ZERO | KEEP } else { ZERO };
                f.allocate(mode, off, len).unwrap();
                apply(&mut model, mode, off, len);
            }
            65..=72 => {
                let (off, len) = (off / B * B, len.div_ceil(B) * B);
                let r = f.allocate(COLLAPSE, off, len);
                if off + len >= size {
                    assert_eq!(errno(r), libc::EINVAL, "{what}: collapse past the end");
                } else {
                    r.unwrap();
                    apply(&mut model, COLLAPSE, off, len);
                }
            }
            73..=80 => {
                let (off, len) = (off / B * B, len.div_ceil(B) * B);
                let r = f.allocate(INSERT, off, len);
                if off >= size {
                    assert_eq!(errno(r), libc::EINVAL, "{what}: insert past the end");
                } else {
                    r.unwrap();
                    apply(&mut model, INSERT, off, len);
                }
            }
            81..=86 => {
                let to = rng.gen_range(0..max);
                f.set_len(to).unwrap();
                model.resize(to as usize, 0);
            }
            87..=92 => f.sync_all().unwrap(),
            93..=95 => f.sync_data().unwrap(),
            _ => {
                drop((f, g));
                fs.unmount().unwrap();
                fsck_clean(&*dev);
                fs = Fs::mount(dev.clone(), test_config()).unwrap();
                f = open_rw(&fs, "/f");
                g = open_rw(&fs, "/g");
            }
        }
        if model.len() as u64 > max * 2 {
            f.set_len(max).unwrap();
            model.truncate(max as usize);
        }
        assert_eq!(f.metadata().unwrap().size, model.len() as u64, "{what}: size");
        if step % 10 == 0 || step == 299 {
            let got = read_all(&f);
            if got != model {
                let at = got.iter().zip(&model).position(|(a, b)| a != b);
                let recent = log[log.len().saturating_sub(12)..].join("\n");
                panic!(
                    "{what}: contents differ (first at {at:?}, sizes {} and {}); recent:\n{recent}",
                    got.len(),
                    model.len()
                );
            }
            check_seek(&f, &model, &what);
        }
    }
    drop((f, g));
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    assert_eq!(fs.read_file("/f").unwrap(), model, "seed {seed}: after remount");
    fs.unmount().unwrap();
}

#[test]
fn random_fallocate_sequences_match_the_model() {
    let seeds: u64 = std::env::var("PWFS_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(6);
    for seed in 0..seeds {
        random_sequence(seed);
    }
}

#[test]
fn preallocation_counts_blocks_reads_zeros_and_survives_remount() {
    let (dev, fs) = mem_fs(32 * MIB);
    let f = open_rw(&fs, "/pre");
    f.allocate(KEEP, 0, 1 << 20).unwrap();
    let md = f.metadata().unwrap();
    assert_eq!(md.size, 0, "KEEP_SIZE keeps the size");
    assert!(md.blocks >= (1 << 20) / 512, "{} sectors for 1 MiB preallocated", md.blocks);
    let free = fs.statfs().blocks_free;
    f.allocate(0, 0, 2 << 20).unwrap();
    assert_eq!(f.metadata().unwrap().size, 2 << 20);
    assert_eq!(free - fs.statfs().blocks_free, 256, "only the second MiB is allocated anew");
    assert!(read_all(&f).iter().all(|b| *b == 0));
    // A write into the middle of the preallocation: one page written, the rest zeros.
    f.write_at(&[7u8; 100], 5000).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
    let fs = Fs::mount(dev.clone(), test_config()).unwrap();
    let got = fs.read_file("/pre").unwrap();
    let mut want = vec![0u8; 2 << 20];
    want[5000..5100].fill(7);
    assert_eq!(got, want);
    // Preallocation past the end survives as well, and a truncate drops it.
    let f = open_rw(&fs, "/pre");
    let before = fs.statfs().blocks_free;
    f.allocate(KEEP, 2 << 20, 1 << 20).unwrap();
    assert_eq!(before - fs.statfs().blocks_free, 256);
    f.set_len(1 << 20).unwrap();
    drop(f);
    fs.sync().unwrap();
    assert_eq!(fs.statfs().blocks_free, before + 256, "truncate frees what lay past the new end");
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

#[test]
fn fallocate_errors_are_linux_errors() {
    let (_dev, fs) = mem_fs(16 * MIB);
    let f = open_rw(&fs, "/f");
    f.write_at(&[1u8; 10 * 4096], 0).unwrap();
    assert_eq!(errno(f.allocate(0, 0, 0)), libc::EINVAL, "empty range");
    assert_eq!(errno(f.allocate(0x80, 0, 1)), libc::EOPNOTSUPP, "unknown bit");
    assert_eq!(errno(f.allocate(PUNCH, 0, 1)), libc::EOPNOTSUPP, "punch without KEEP_SIZE");
    assert_eq!(errno(f.allocate(PUNCH | ZERO | KEEP, 0, 1)), libc::EOPNOTSUPP, "punch and zero");
    assert_eq!(
        errno(f.allocate(COLLAPSE | KEEP, 0, 4096)),
        libc::EOPNOTSUPP,
        "collapse with KEEP_SIZE (Linux 6.15 on)"
    );
    assert_eq!(errno(f.allocate(COLLAPSE, 100, 4096)), libc::EINVAL, "unaligned collapse");
    assert_eq!(errno(f.allocate(COLLAPSE, 0, 10 * 4096)), libc::EINVAL, "collapse to the end");
    assert_eq!(errno(f.allocate(INSERT, 10 * 4096, 4096)), libc::EINVAL, "insert at the end");
    assert_eq!(errno(f.allocate(0, 1 << 62, 1 << 62)), libc::EFBIG, "past the largest file");
    let ro = OpenOptions::new().read(true).open(&fs, "/f").unwrap();
    assert_eq!(errno(ro.allocate(0, 0, 1)), libc::EBADF, "read-only handle");
    fs.create_dir("/d", 0o755).unwrap();
    let d = fs.metadata("/d").unwrap().ino;
    assert_eq!(errno(fs.fallocate(d, 0, 0, 1)), libc::EISDIR);
    let fifo = fs.mknod(1, b"fifo", 0o010644, 0, &pwfs::Creator::new(0, 0)).unwrap().ino;
    assert_eq!(errno(fs.fallocate(fifo, 0, 0, 1)), libc::ESPIPE);
    // Insert range may not move blocks preallocated past the end out of the largest
    // file (their block numbers would wrap onto the file's first blocks).
    let max = pwfs::format::MAX_FILE_SIZE;
    f.allocate(KEEP, max - 4096, 4096).unwrap();
    assert_eq!(errno(f.allocate(INSERT, 4096, 4096)), libc::EFBIG, "insert past the largest file");
    assert_eq!(fs.read_file("/f").unwrap(), vec![1u8; 10 * 4096], "nothing moved");
    f.set_len(10 * 4096).unwrap();
    // A preallocation larger than the free space: ENOSPC, and the file system goes on.
    assert_eq!(errno(f.allocate(0, 0, 64 * MIB)), libc::ENOSPC);
    f.write_at(&[2u8; 4096], 0).unwrap();
    f.sync_all().unwrap();
    fs.unmount().unwrap();
}

/// A punch as ext4 makes it: nothing at or past the end of the file; one running past
/// it stops at the end's block, so blocks preallocated beyond it stay; a punch and a
/// zeroing change the modification time as well as the change time.
#[test]
fn punches_stop_at_the_end_of_the_file_and_change_both_times() {
    let (dev, fs) = mem_fs(16 * MIB);
    let f = open_rw(&fs, "/f");
    f.write_at(&[1u8; 5000], 0).unwrap();
    f.allocate(KEEP, 0, 16 * B).unwrap();
    let before = fs.metadata("/f").unwrap();
    assert_eq!(before.blocks, 16 * 8, "16 blocks, in 512-byte units");
    let pause = || std::thread::sleep(std::time::Duration::from_millis(5));
    pause();
    f.allocate(PUNCH | KEEP, 8 * B, 4 * B).unwrap();
    let after = fs.metadata("/f").unwrap();
    let t = |t: pwfs::format::Timespec| (t.sec, t.nsec);
    assert_eq!(after.blocks, before.blocks, "past the end: no block");
    assert!(t(after.mtime) > t(before.mtime) && t(after.ctime) > t(before.ctime), "past the end: both times");
    let before = after;
    pause();
    f.allocate(PUNCH | KEEP, B, 15 * B).unwrap();
    let after = fs.metadata("/f").unwrap();
    assert_eq!(after.blocks, 15 * 8, "only the block holding the end went; the preallocated ones stay");
    let t = |t: pwfs::format::Timespec| (t.sec, t.nsec);
    assert!(t(after.mtime) > t(before.mtime) && t(after.ctime) > t(before.ctime), "a punch changes both times");
    let mut want = vec![1u8; 5000];
    want[B as usize..].fill(0);
    assert_eq!(fs.read_file("/f").unwrap(), want);
    pause();
    f.allocate(ZERO | KEEP, 100, 10).unwrap();
    let zeroed = fs.metadata("/f").unwrap();
    assert!(t(zeroed.mtime) > t(after.mtime) && t(zeroed.ctime) > t(after.ctime), "a zeroing changes both times");
    want[100..110].fill(0);
    assert_eq!(fs.read_file("/f").unwrap(), want);
    // A range inside one block that starts on the block's boundary (it once zeroed
    // nothing: it has no head edge, and its tail edge was taken for the head's).
    f.write_at(&[7u8; 3 * B as usize], 0).unwrap();
    want = vec![7u8; 3 * B as usize];
    f.allocate(ZERO | KEEP, B, 735).unwrap();
    want[B as usize..B as usize + 735].fill(0);
    f.allocate(PUNCH | KEEP, 2 * B, 100).unwrap();
    want[2 * B as usize..2 * B as usize + 100].fill(0);
    assert!(fs.read_file("/f").unwrap() == want, "zeroed and punched from a block boundary");
    fs.evict_cache().unwrap();
    assert!(fs.read_file("/f").unwrap() == want, "the same, read cold");
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// Blocks freed by one file and preallocated by another read as zeros at every
/// point a power cut could leave, and fsync'd writes into them survive.
#[test]
fn preallocated_blocks_never_show_old_contents_after_a_crash() {
    let image = formatted_image(16 * MIB, &MkfsOptions::default());
    let (dev, fs) = sim_fs(image, Default::default(), test_config());
    fs.write_file("/old", &vec![0xAAu8; 1 << 20]).unwrap();
    fs.sync().unwrap();
    fs.remove_file("/old").unwrap();
    fs.sync().unwrap();
    let base = dev.start_recording();
    let f = open_rw(&fs, "/new");
    f.allocate(0, 0, 1 << 20).unwrap();
    f.sync_all().unwrap();
    f.write_at(&[0x55u8; 8192], 4096 * 10).unwrap();
    f.sync_data().unwrap();
    // Unsynced: may or may not survive, never as anything but these bytes or zeros.
    f.write_at(&[0x66u8; 4096], 4096 * 40).unwrap();
    f.allocate(PUNCH | KEEP, 4096 * 12, 4096).unwrap();
    f.allocate(ZERO | KEEP, 4096 * 50, 4096 * 4).unwrap();
    drop(f);
    fs.sync().unwrap();
    // Collapse and insert move the block map in one transaction each: a second file,
    // 8 blocks each stamped with its index, loses blocks 2..4 and gains a hole at 1.
    let g = open_rw(&fs, "/moved");
    for k in 0..8u8 {
        g.write_at(&[0x10 + k; 4096], k as u64 * 4096).unwrap();
    }
    g.sync_all().unwrap();
    g.allocate(COLLAPSE, 2 * 4096, 2 * 4096).unwrap();
    g.allocate(INSERT, 4096, 4096).unwrap();
    g.sync_all().unwrap();
    drop(g);
    let log = dev.log();
    let synced_at = log.len();
    drop(fs);
    for (i, point) in (0..=synced_at).step_by((synced_at / 60).max(1)).chain([synced_at]).enumerate() {
        let img = crash_image(&base, &log, point, i as u64);
        let (dev, fs) = sim_fs(img, Default::default(), test_config());
        fsck_clean(&*dev);
        if let Ok(got) = fs.read_file("/new") {
            for (k, chunk) in got.chunks(4096).enumerate() {
                let ok = chunk.iter().all(|b| *b == 0)
                    || (k == 10 || k == 11) && chunk.iter().all(|b| *b == 0x55)
                    || k == 40 && chunk.iter().all(|b| *b == 0x66);
                assert!(ok, "crash point {point}: block {k} of /new holds {:#x}", chunk[0]);
            }
        }
        if point == synced_at {
            let got = fs.read_file("/new").unwrap();
            assert!(got[4096 * 10..4096 * 12].iter().all(|b| *b == 0x55), "fdatasync'd data lost");
        }
        // /moved is one of its synced states: before the collapse, after it, or after
        // the insert, never a mix.
        if let Ok(got) = fs.read_file("/moved") {
            let stamps: Vec<u8> = got.chunks(4096).map(|c| c[0]).collect();
            let states: [&[u8]; 3] = [
                &[0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17],
                &[0x10, 0x11, 0x14, 0x15, 0x16, 0x17],
                &[0x10, 0, 0x11, 0x14, 0x15, 0x16, 0x17],
            ];
            let whole = got.chunks(4096).all(|c| c.iter().all(|b| *b == c[0]));
            assert!(
                whole && (states.contains(&stamps.as_slice()) || stamps.is_empty()),
                "crash point {point}: /moved holds {stamps:x?}"
            );
            if point == log.len() {
                assert_eq!(stamps, states[2], "the synced collapse and insert");
            }
        } else {
            assert!(point < synced_at, "the synced /moved is lost");
        }
        fs.unmount().unwrap();
        fsck_clean(&*dev);
    }
}

#[test]
fn writers_and_punchers_of_one_file_race_without_losing_bytes_outside_the_holes() {
    let (dev, fs) = mem_fs(64 * MIB);
    let f = Arc::new(open_rw(&fs, "/race"));
    f.write_at(&vec![9u8; 4 << 20], 0).unwrap();
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                for _ in 0..300 {
                    // Thread 0 writes the first half, thread 1 punches and zeroes the second.
                    let blk = rng.gen_range(0..512u64) + 512 * t;
                    if t == 0 {
                        f.write_at(&[9u8; 4096], blk * B).unwrap();
                    } else if rng.gen_bool(0.5) {
                        f.allocate(PUNCH | KEEP, blk * B, B).unwrap();
                    } else {
                        f.allocate(ZERO | KEEP, blk * B, B).unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let got = read_all(&f);
    assert!(got[..2 << 20].iter().all(|b| *b == 9), "the written half lost bytes");
    assert!(got[2 << 20..].iter().all(|b| *b == 9 || *b == 0));
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// A punch whose edges fall in a hole writes nothing there, even where
/// the hole's zeros are cached (a read of the file): no block is allocated (st_blocks
/// stays 0, SEEK_DATA still finds no data) and a punch on a full file system works.
#[test]
fn a_punch_in_a_cached_hole_allocates_nothing() {
    let (dev, fs) = mem_fs(16 * MIB);
    let f = open_rw(&fs, "/f");
    f.set_len(MIB).unwrap();
    assert_eq!(fs.read_file("/f").unwrap().len(), MIB as usize, "every hole page is cached now");
    f.allocate(PUNCH | KEEP, 100, 200).unwrap();
    f.allocate(PUNCH | KEEP, 5000, 3000).unwrap();
    fs.sync().unwrap();
    assert_eq!(fs.metadata("/f").unwrap().blocks, 0);
    assert!(fs.read_file("/f").unwrap().iter().all(|b| *b == 0));
    drop(f);
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}

/// As ext4: a write or fallocate that would clear the set-ID bits of an append-only
/// file (a caller without CAP_FSETID) is refused with EPERM, the bits kept.
#[test]
fn clearing_set_id_bits_of_an_append_only_file_is_refused() {
    let (_dev, fs) = mem_fs(16 * MIB);
    let f = open_rw(&fs, "/f");
    let ino = f.ino();
    fs.setattr(ino, &pwfs::SetAttr { mode: Some(0o6777), ..Default::default() }).unwrap();
    fs.set_flags(ino, pwfs::fs::FS_APPEND_FL).unwrap();
    let outsider = |_gid: u32| false;
    for change in [pwfs::PrivChange::Write, pwfs::PrivChange::Attributes] {
        let r = fs.kill_privs(ino, Some(&outsider), change);
        if change == pwfs::PrivChange::Write {
            assert_eq!(errno(r), libc::EPERM);
        }
        assert_eq!(fs.metadata("/f").unwrap().mode & 0o7777, 0o6777, "{change:?}: the bits stay");
    }
    // A caller with CAP_FSETID (no set-ID callback) goes on.
    assert!(!fs.kill_privs(ino, None, pwfs::PrivChange::Write).unwrap());
}

/// A preallocation that runs out of space after its first piece (256 MiB) leaves what
/// it allocated inside the file's size, as ext4 does, not as blocks past the end that
/// nothing shows.
#[test]
fn a_preallocation_cut_short_by_enospc_keeps_what_it_allocated_inside_the_size() {
    let (dev, fs) = mem_fs(320 * MIB);
    let f = open_rw(&fs, "/f");
    assert_eq!(errno(f.allocate(0, 0, 400 * MIB)), libc::ENOSPC);
    let md = fs.metadata("/f").unwrap();
    assert_eq!(md.size, 256 * MIB, "the first piece");
    assert_eq!(md.blocks * 512, 256 * MIB);
    // With KEEP_SIZE the size stays.
    let g = open_rw(&fs, "/g");
    assert_eq!(errno(g.allocate(KEEP, 0, 400 * MIB)), libc::ENOSPC);
    assert_eq!(fs.metadata("/g").unwrap().size, 0);
    drop((f, g));
    fs.unmount().unwrap();
    fsck_clean(&*dev);
}
