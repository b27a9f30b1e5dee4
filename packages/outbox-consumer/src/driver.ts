// The conformance suite's driver (docs/contract/conformance.md) for this package. SIGTERM is
// heard from the first moment (before the libraries load): an instance stopped while it
// starts exits at once, one that runs finishes what it holds, releases and leaves.

let stop: (() => Promise<void>) | null = null;
let terminated = false;

const finish = async (): Promise<void> => {
  if (stop) await stop();
  process.exit(0);
};

process.on("SIGTERM", () => {
  terminated = true;
  void finish();
});

const instance = await import("./instance.js");
stop = instance.start();
if (terminated) await finish();
