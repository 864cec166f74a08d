/* Prints each of its arguments, argv[0] included, ended by a NUL: a script's interpreter,
   to compare the command line the kernel runs for a script with ours. */
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  for (int i = 0; i < argc; i++)
    fwrite(argv[i], 1, strlen(argv[i]) + 1, stdout);
  return 0;
}
