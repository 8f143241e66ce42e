"""Where the time of a dual_mlp step goes, on this machine's GPUs.

    python bench/speed.py --dataset DIR [--epochs 20] [--out bench/results]

Runs dual_mlp.py at the default model (784-500-10, batch 5000 per worker) on
GPUs ``0 1`` and ``0 0`` with each --avg, and records per run the mean train,
exchange and average time per step and samples/s (both workers), as
dual_mlp.py's own --json summaries report them."""
import argparse
import os
import tempfile

from common import RESULTS, dual_mlp, record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="a data set with 50,000 training images")
    parser.add_argument("--epochs", type=int, default=20, help="5 steps per epoch per worker")
    parser.add_argument("--devices", nargs="+", default=["0 1", "0 0"])
    parser.add_argument("--avg", nargs="+", default=["theano", "pycuda", "cpu"])
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for devices in args.devices:
            for avg in args.avg:
                s = dual_mlp(*devices.split(), "--dataset", args.dataset, "--epochs",
                             args.epochs, "--avg", avg, json_path=os.path.join(tmp, "run.json"))
                us = s["step_us"]
                run = dict(devices=devices, avg=avg, transport=s["transport"], step_us=us,
                           overhead_us=us["exchange"] + us["average"],
                           overhead_without_waiting_us=us["exchange"] + us["average"]
                           - us["waiting"],
                           samples_per_s=s["samples_per_s"],
                           steps=s["epochs_run"] * s["steps_per_epoch"],
                           validation_errors=s["validation_errors"], device_name=s["device_name"])
                runs.append(run)
                print("{devices} --avg {avg:7s} train {step_us[train]:6.0f} us | publish "
                      "{step_us[publish]:4.0f} barriers {step_us[barrier]:4.0f} waiting "
                      "{step_us[waiting]:4.0f} copy {step_us[copy]:4.0f} average "
                      "{step_us[average]:5.0f} | overhead {overhead_us:5.0f} us, without waiting "
                      "{overhead_without_waiting_us:5.0f} us | {samples_per_s:,.0f} samples/s"
                      .format(**run), flush=True)
    record("speed", args.out, dataset=args.dataset, epochs=args.epochs, batch_size=5000,
           runs=runs)


if __name__ == "__main__":
    main()
