/* The bundled example of `branchtrace demo`: a list lookup that misses, and a crash.
 *
 * total() trusts find() to succeed; for 6, find() walks off the end of the list and
 * returns NULL, and total() dereferences it.  The branch trace shows how we got there.
 */
#include <stdio.h>
#include <stdlib.h>

struct node {
  int value;
  struct node *next;
};

__attribute__((noinline)) static struct node *push(struct node *list, int value) {
  struct node *n = malloc(sizeof *n);
  n->value = value;
  n->next = list;
  return n;
}

__attribute__((noinline)) static struct node *find(struct node *list, int value) {
  while (list != NULL && list->value != value)
    list = list->next;
  return list;
}

__attribute__((noinline)) static int total(const struct node *n) {
  return n->value * 2;
}

int main(void) {
  struct node *list = NULL;
  for (int v = 1; v <= 5; v++)
    list = push(list, v);
  int sum = 0;
  for (int v = 1; v <= 6; v++) {
    sum += total(find(list, v));
    printf("after %d: %d\n", v, sum);
  }
  return 0;
}
