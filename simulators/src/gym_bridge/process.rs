//! One Python worker process (`python -m fedrl_bridge.worker`) and the requests sent to it.
//!
//! Invariants:
//! - No request waits past its deadline: frames are written by a writer thread and read by a
//!   reader thread, and the caller only waits on a channel with a timeout, so a worker that
//!   hangs (or stops reading its stdin) costs at most the deadline.
//! - No worker outlives its owner: dropping a [`WorkerProcess`] closes its stdin (the worker
//!   exits at end of input), then kills and reaps it; on Linux every worker is started with
//!   `PR_SET_PDEATHSIG = SIGKILL` from one long-lived spawner thread (the signal follows the
//!   thread that forked, so a short-lived thread would kill its workers when it ends), which
//!   covers an agent killed by SIGKILL, SIGTERM or Ctrl-C without running destructors.

use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::BridgeError;
use super::protocol::{self, Frame};

/// A running worker: its process, the writer thread's queue and the reader thread's frames.
pub struct WorkerProcess {
    child: Child,
    pid: u32,
    /// Framed requests for the writer thread; dropping it closes the worker's stdin.
    to_writer: Option<Sender<Vec<u8>>>,
    from_reader: Receiver<Result<Frame, String>>,
    python: PathBuf,
}

/// What the spawner thread is asked to start.
struct SpawnRequest {
    python: PathBuf,
    pythonpath: Option<PathBuf>,
    reply: Sender<std::io::Result<Child>>,
}

/// The long-lived thread that forks every worker (see the module doc: `PR_SET_PDEATHSIG`
/// follows the forking thread).
fn spawner() -> &'static Mutex<Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("gym-bridge-spawner".into())
            .spawn(move || {
                for req in rx {
                    let child = command(&req.python, req.pythonpath.as_deref()).spawn();
                    let _ = req.reply.send(child);
                }
            })
            .expect("cannot start the gym bridge's spawner thread");
        Mutex::new(tx)
    })
}

fn command(python: &Path, pythonpath: Option<&Path>) -> Command {
    let mut cmd = Command::new(python);
    cmd.args(["-u", "-m", "fedrl_bridge.worker"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(p) = pythonpath {
        let mut v = p.as_os_str().to_owned();
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            v.push(":");
            v.push(old);
        }
        cmd.env("PYTHONPATH", v);
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec the closure only calls prctl, getppid and _exit, which
        // are async-signal-safe, and touches no memory but the copied `parent`.
        let parent = std::process::id() as libc::pid_t;
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                // The parent may have died between fork and prctl: then nobody would kill us.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    cmd
}

impl WorkerProcess {
    /// Starts `python -m fedrl_bridge.worker` with `pythonpath` prepended to `PYTHONPATH`.
    pub fn spawn(python: &Path, pythonpath: Option<&Path>) -> Result<Self, BridgeError> {
        let start_err = |reason: String| BridgeError::Start {
            python: python.display().to_string(),
            reason,
        };
        if !python.exists() {
            return Err(start_err(
                "no such interpreter (run scripts/install-python-bridge.sh, or set \
                 task.gymnasium.python or FEDRL_PYTHON)"
                    .into(),
            ));
        }
        let (reply, got) = mpsc::channel();
        spawner()
            .lock()
            .map_err(|_| start_err("spawner lock poisoned".into()))?
            .send(SpawnRequest {
                python: python.to_path_buf(),
                pythonpath: pythonpath.map(Path::to_path_buf),
                reply,
            })
            .map_err(|_| start_err("spawner thread is gone".into()))?;
        let mut child = got
            .recv()
            .map_err(|_| start_err("spawner thread is gone".into()))?
            .map_err(|e| start_err(e.to_string()))?;
        let pid = child.id();
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(start_err("no pipes to the worker".into()));
        };
        let (to_writer, writer_rx) = mpsc::channel::<Vec<u8>>();
        let (reader_tx, from_reader) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("gym-worker-{pid}-w"))
            .spawn(move || writer(stdin, writer_rx))
            .map_err(|e| start_err(e.to_string()))?;
        std::thread::Builder::new()
            .name(format!("gym-worker-{pid}-r"))
            .spawn(move || {
                let mut r = BufReader::with_capacity(1 << 16, stdout);
                loop {
                    let f = protocol::read_frame(&mut r);
                    let end = !matches!(f, Ok(Some(_)));
                    let msg = match f {
                        Ok(Some(frame)) => Ok(frame),
                        Ok(None) => Err("the worker closed its stdout (it exited)".to_string()),
                        Err(e) => Err(e),
                    };
                    if reader_tx.send(msg).is_err() || end {
                        return;
                    }
                }
            })
            .map_err(|e| start_err(e.to_string()))?;
        Ok(Self {
            child,
            pid,
            to_writer: Some(to_writer),
            from_reader,
            python: python.to_path_buf(),
        })
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends one request and waits at most `timeout` for its reply. An ERROR reply becomes
    /// [`BridgeError::Worker`]; a reply of another type than `expect`, a crash or the deadline
    /// are faults after which the worker must not be used again.
    pub fn request(
        &mut self,
        kind: u16,
        count: u32,
        payload: &[u8],
        expect: u16,
        timeout: Duration,
    ) -> Result<Frame, BridgeError> {
        let mut frame = Vec::with_capacity(protocol::HEADER_LEN + payload.len());
        protocol::write_frame(&mut frame, kind, count, payload)
            .map_err(|e| BridgeError::Protocol(e.to_string()))?;
        let sent = self
            .to_writer
            .as_ref()
            .is_some_and(|tx| tx.send(frame).is_ok());
        if !sent {
            return Err(self.crashed("its stdin is closed".into()));
        }
        let deadline = Instant::now() + timeout;
        match self
            .from_reader
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(Ok(f)) if f.kind == expect => Ok(f),
            Ok(Ok(f)) if f.kind == protocol::ERROR => Err(BridgeError::Worker(
                String::from_utf8_lossy(&f.payload).into_owned(),
            )),
            Ok(Ok(f)) => Err(BridgeError::Protocol(format!(
                "reply of type {} to a request of type {kind} (expected {expect})",
                f.kind
            ))),
            Ok(Err(e)) => Err(self.crashed(e)),
            Err(RecvTimeoutError::Timeout) => Err(BridgeError::Timeout {
                pid: self.pid,
                after: timeout,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(self.crashed("reader ended".into())),
        }
    }

    /// A crash error naming the exit status when the process has already ended.
    fn crashed(&mut self, what: String) -> BridgeError {
        // Give the kernel a moment to report the exit that closed the pipe.
        let mut status = None;
        for _ in 0..20 {
            if let Ok(Some(s)) = self.child.try_wait() {
                status = Some(s);
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        BridgeError::Crashed {
            pid: self.pid,
            reason: match status {
                Some(s) => format!("{what}; {s}"),
                None => what,
            },
        }
    }

    /// The interpreter this worker runs.
    pub fn python(&self) -> &Path {
        &self.python
    }
}

fn writer(stdin: ChildStdin, rx: Receiver<Vec<u8>>) {
    use std::io::Write;
    let mut w = BufWriter::with_capacity(1 << 16, stdin);
    for frame in rx {
        if w.write_all(&frame).and_then(|()| w.flush()).is_err() {
            return;
        }
    }
    // The queue closed: dropping `w` closes the worker's stdin, so it exits at end of input.
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // Close stdin (the worker exits cleanly at end of input), give it a moment to close its
        // environments, then make sure it is gone and reaped.
        self.to_writer = None;
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
