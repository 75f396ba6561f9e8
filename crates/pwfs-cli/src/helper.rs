//! `mount.fuse.pwfs`: pwfs as mount(8)'s helper, and its `-o` options.
//!
//! For a file system of type `fuse.pwfs` (`mount -t fuse.pwfs IMAGE DIR -o OPTS`, or an
//! fstab line `/srv/a.img /mnt/a fuse.pwfs defaults,cache=256M 0 0`), mount(8) runs
//! `/sbin/mount.fuse.pwfs IMAGE DIR [-sfnv] [-o OPTS]` and waits for it to return.
//! `pwfs install-helper` makes that name a symbolic link to the `pwfs` binary, which
//! behaves as the helper when called by it (argv[0]). The helper mounts in the
//! background (the serving process detaches once the mount is up) and refuses a
//! missing image rather than create one. `-o remount,...` remounts an existing mount
//! (mount(8) calls the helper for that too): the kernel makes the superblock read-only
//! or writable again, and the serving process passes it on to the engine.

use crate::mount::{MountArgs, MountOpts};
use pwfs::FetchPolicy;
use pwfs_fuse::KernelCache;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The names mount(8) looks for (`mount.<type>`), the second for `-t pwfs`.
pub const HELPER_NAMES: [&str; 2] = ["mount.fuse.pwfs", "mount.pwfs"];

/// Whether this process was started as the mount helper.
pub fn called_as_helper() -> bool {
    let arg0 = std::env::args_os().next().unwrap_or_default();
    let name = Path::new(&arg0).file_name().unwrap_or_default().to_string_lossy().into_owned();
    HELPER_NAMES.contains(&name.as_str())
}

/// Apply one `-o` option string to `o`, left to right (a later option overrides an
/// earlier one: `ro,rw` is rw). Unknown options are an error unless `sloppy` (`-s`).
pub fn parse_options(opts: &str, sloppy: bool, o: &mut MountOpts) -> Result<(), String> {
    let flag = |o: &mut MountOpts, bit: libc::c_ulong, on: bool| {
        if on {
            o.flags |= bit
        } else {
            o.flags &= !bit
        }
    };
    for item in opts.split(',').filter(|s| !s.is_empty()) {
        let (key, value) = match item.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (item, None),
        };
        match (key, value) {
            ("cache", Some(v)) => o.cache = Some(crate::parse_size(v)?),
            ("fetch", Some(v)) => {
                o.fetch = Some(match v {
                    "blocking" => FetchPolicy::Blocking,
                    "async-fg" => FetchPolicy::AsyncForeground,
                    "async-bg" => FetchPolicy::AsyncBackground,
                    "lazy" => FetchPolicy::Lazy,
                    _ => return Err(format!("fetch={v}: expected blocking, async-fg, async-bg or lazy")),
                })
            }
            ("stack", Some(v)) => {
                o.stack = Some(match v {
                    "sync" => pwfs::Stack::Sync,
                    "async" => pwfs::Stack::Async,
                    _ => return Err(format!("stack={v}: expected sync or async")),
                })
            }
            ("hitchhike", Some(v)) => {
                o.hitchhike = Some(match v {
                    "on" => true,
                    "off" => false,
                    _ => return Err(format!("hitchhike={v}: expected on or off")),
                })
            }
            ("shim", Some(v)) => {
                o.shim = Some(match v {
                    "on" => true,
                    "off" => false,
                    _ => return Err(format!("shim={v}: expected on or off")),
                })
            }
            ("poll", Some(v)) => {
                o.poll = Some(match v {
                    "on" => true,
                    "off" => false,
                    _ => return Err(format!("poll={v}: expected on or off")),
                })
            }
            ("kernel_cache", Some(v)) => {
                o.kernel_cache = Some(match v {
                    "off" => KernelCache::Off,
                    "write-through" => KernelCache::WriteThrough,
                    "write-back" => KernelCache::WriteBack,
                    _ => return Err(format!("kernel_cache={v}: expected off, write-through or write-back")),
                })
            }
            ("fuse_uring", Some(v)) => {
                o.fuse_uring = Some(match v {
                    "on" => true,
                    "off" => false,
                    _ => return Err(format!("fuse_uring={v}: expected on or off")),
                })
            }
            ("check", None) => o.check = true,
            ("threads", Some(v)) => match v.parse::<usize>() {
                Ok(n) if (1..=1024).contains(&n) => o.threads = Some(n),
                _ => return Err(format!("threads={v}: expected a number of threads from 1 to 1024")),
            },
            ("allow_other", None) => o.allow_other = true,
            ("fsname", Some(v)) if !v.is_empty() => o.fsname = Some(v.to_string()),
            ("subtype", Some("pwfs")) => {}
            ("remount", None) => o.remount = true,
            ("ro", None) => flag(o, libc::MS_RDONLY, true),
            ("rw", None) => flag(o, libc::MS_RDONLY, false),
            ("suid", None) => o.suid = true,
            ("nosuid", None) => o.suid = false,
            ("dev", None) => o.dev = true,
            ("nodev", None) => o.dev = false,
            ("exec", None) => flag(o, libc::MS_NOEXEC, false),
            ("noexec", None) => flag(o, libc::MS_NOEXEC, true),
            ("atime" | "relatime" | "strictatime", None) => {
                o.atime = Some(true);
                flag(o, libc::MS_NOATIME, false);
                flag(o, libc::MS_RELATIME, item == "relatime");
                flag(o, libc::MS_STRICTATIME, item == "strictatime");
            }
            ("noatime", None) => {
                o.atime = Some(false);
                flag(o, libc::MS_NOATIME, true);
            }
            ("diratime", None) => flag(o, libc::MS_NODIRATIME, false),
            ("nodiratime", None) => flag(o, libc::MS_NODIRATIME, true),
            ("norelatime", None) => flag(o, libc::MS_RELATIME, false),
            ("nostrictatime", None) => flag(o, libc::MS_STRICTATIME, false),
            ("lazytime", None) => flag(o, libc::MS_LAZYTIME, true),
            ("nolazytime", None) => flag(o, libc::MS_LAZYTIME, false),
            ("sync", None) => flag(o, libc::MS_SYNCHRONOUS, true),
            ("async", None) => flag(o, libc::MS_SYNCHRONOUS, false),
            ("dirsync", None) => flag(o, libc::MS_DIRSYNC, true),
            // For mount(8) and systemd, not for the file system.
            ("defaults" | "_netdev" | "nofail" | "auto" | "noauto", None) => {}
            // User mounts: libmount checks them and adds nosuid, nodev, noexec itself
            // (libfuse's helper ignores them too).
            ("user" | "users" | "nouser" | "nousers" | "owner" | "group", None) => {}
            ("user" | "uhelper", Some(_)) => {}
            // FUSE's own kernel options, which pwfs sets itself: mount(8) passes them back
            // from /proc/self/mountinfo at a remount.
            ("default_permissions", None) => {}
            ("user_id" | "group_id" | "rootmode" | "max_read" | "blksize", Some(_)) => {}
            (k, _) if k.starts_with("x-") || k == "comment" => {}
            _ if sloppy => {}
            _ => {
                return Err(format!(
                    "unknown mount option {item:?} (pwfs takes cache=SIZE, fetch=POLICY, stack=sync|async, poll=on|off, kernel_cache=MODE, fuse_uring=on|off, threads=N, \
                     shim=on|off, hitchhike=on|off, check, allow_other, fsname=NAME, and ro/rw, suid/nosuid, dev/nodev, exec/noexec, \
                     the atime options, sync/async, dirsync)"
                ))
            }
        }
    }
    Ok(())
}

/// `mount.fuse.pwfs IMAGE DIR [-sfnv] [-N NS] [-o OPTS] [-t TYPE]`.
pub fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mount.fuse.pwfs: {e}");
            // mount(8)'s "mount failure".
            ExitCode::from(32)
        }
    }
}

fn run(args: Vec<String>) -> Result<ExitCode, String> {
    let usage = "usage: mount.fuse.pwfs IMAGE DIR [-sfnv] [-o OPTIONS]";
    let (mut positional, mut opts) = (Vec::new(), Vec::new());
    let (mut sloppy, mut fake, mut verbose) = (false, false, false);
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" => opts.push(it.next().ok_or(usage)?),
            s if s.starts_with("-o") => opts.push(s[2..].to_string()),
            "-t" => {
                let t = it.next().ok_or(usage)?;
                if t != pwfs_fuse::FS_TYPE && t != "pwfs" {
                    return Err(format!("type {t}: this helper mounts {}", pwfs_fuse::FS_TYPE));
                }
            }
            "-N" => return Err("-N (another mount namespace) is not supported".into()),
            "-h" | "--help" => {
                println!("{usage}");
                return Ok(ExitCode::SUCCESS);
            }
            s if s.starts_with('-') && s.len() > 1 => {
                for c in s[1..].chars() {
                    match c {
                        's' => sloppy = true,
                        'f' => fake = true,
                        'n' => {}
                        'v' => verbose = true,
                        _ => return Err(format!("unknown flag -{c}; {usage}")),
                    }
                }
            }
            _ => positional.push(a),
        }
    }
    let [image, mountpoint] = <[String; 2]>::try_from(positional).map_err(|_| usage.to_string())?;
    let (image, mountpoint) = (PathBuf::from(image), PathBuf::from(mountpoint));
    // mount(8) passes vfs flags only when they differ from its defaults (suid, dev,
    // exec): "suid" never arrives, "nosuid" does. So the helper starts from mount(8)'s
    // defaults, as every block file system does; `pwfs mount` keeps FUSE's (nosuid,
    // nodev).
    let mut o = MountOpts { suid: true, dev: true, ..Default::default() };
    for s in &opts {
        parse_options(s, sloppy, &mut o)?;
    }
    if o.remount {
        // mount(8) passes the options given (with fstab's, if it has a line): start from
        // the mount's own flags so that those not named stay as they are.
        let mut merged = crate::mount::current_flags(&mountpoint)?;
        for s in &opts {
            parse_options(s, sloppy, &mut merged)?;
        }
        if verbose {
            eprintln!("mount.fuse.pwfs: remount {} with flags {:#x}", mountpoint.display(), merged.flags);
        }
        if fake {
            return Ok(ExitCode::SUCCESS);
        }
        crate::mount::remount(&mountpoint, &merged)?;
        return Ok(ExitCode::SUCCESS);
    }
    if !image.exists() {
        return Err(format!(
            "{}: no such image (create it with `pwfs mkfs {} --size 4G`)",
            image.display(),
            image.display()
        ));
    }
    if verbose {
        eprintln!("mount.fuse.pwfs: mounting {} at {}", image.display(), mountpoint.display());
    }
    if fake {
        return Ok(ExitCode::SUCCESS);
    }
    let a = MountArgs { image, mountpoint, size: 0, daemon: true, create: false, opts: o };
    crate::mount::run(&a).map(|_| ExitCode::SUCCESS)
}

/// `pwfs install-helper [DIR]`: DIR/mount.fuse.pwfs → this binary (a symbolic link;
/// one already there is replaced, anything else is refused).
pub fn install(dir: &Path) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().and_then(|p| p.canonicalize()).map_err(|e| format!("this binary: {e}"))?;
    let link = dir.join(HELPER_NAMES[0]);
    match std::fs::symlink_metadata(&link) {
        Ok(m) if m.file_type().is_symlink() => {
            std::fs::remove_file(&link).map_err(|e| format!("{}: {e}", link.display()))?
        }
        Ok(_) => return Err(format!("{} exists and is not a symbolic link; not replacing it", link.display())),
        Err(_) => {}
    }
    std::os::unix::fs::symlink(&exe, &link).map_err(|e| format!("{}: {e}", link.display()))?;
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_apply_left_to_right_and_unknown_ones_are_refused() {
        let mut o = MountOpts::default();
        parse_options("defaults,cache=64M,ro,noatime,suid,nofail,_netdev,x-systemd.automount", false, &mut o).unwrap();
        assert_eq!(o.cache, Some(64 << 20));
        assert!(o.suid && !o.dev);
        assert_eq!(o.flags, libc::MS_RDONLY | libc::MS_NOATIME);
        parse_options("rw,dev,fetch=lazy,kernel_cache=off,fsname=/img,check,allow_other,noexec", false, &mut o)
            .unwrap();
        assert_eq!(o.flags, libc::MS_NOATIME | libc::MS_NOEXEC);
        assert!(o.dev && o.check && o.allow_other);
        assert_eq!(o.fetch, Some(FetchPolicy::Lazy));
        assert_eq!(o.kernel_cache, Some(KernelCache::Off));
        assert_eq!(o.fsname.as_deref(), Some("/img"));
        let e = parse_options("cache=1G,bogus", false, &mut o).unwrap_err();
        assert!(e.contains("unknown mount option \"bogus\""), "{e}");
        parse_options("bogus", true, &mut o).unwrap();
        assert!(parse_options("fetch=sometimes", false, &mut o).is_err());
        assert!(parse_options("stack=later", false, &mut o).is_err());
        assert!(parse_options("poll=yes", false, &mut o).is_err());
        parse_options("stack=async,poll=on", false, &mut o).unwrap();
        assert_eq!((o.stack, o.poll), (Some(pwfs::Stack::Async), Some(true)));
        assert!(parse_options("cache=lots", false, &mut o).is_err());
    }
}
