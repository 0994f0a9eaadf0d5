set terminal pngcairo size 900,520 font ",11"
set output "loss.png"
set datafile separator ","
set datafile missing ""
set key top right
set grid
set xlabel "step"
set ylabel "validation loss (bytes, nats)"
set title "Tiny Llama on the Python 3.12 standard library (H200, seed 1234)"
plot "loss_bf16_baseline.csv" every ::1 using 1:3 with linespoints pt 7 ps 0.6 title "bf16 baseline", \
     "loss.csv" every ::1 using 1:3 with linespoints pt 5 ps 0.6 title "MXFP4 fprop+dgrad+wgrad, H16 on wgrad (this capture)", \
     "loss_mxfp4_no_rotation_partial.csv" every ::1 using 1:3 with linespoints pt 9 ps 0.6 title "MXFP4 all GEMMs, no rotation (stopped at step 300)"
